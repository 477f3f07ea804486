"""The host-load sampler on this machine, with real busy-loop processes as the foreign load.

The machine is shared with other work, so no test asserts a quiet number: a busy loop
must show as foreign, and the same window read with and without that loop counted as
the experiment's own must differ by about its core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import pytest

from infra_agent.target.host_load import (
    HostLoad,
    HostSampler,
    host_summary,
    listener_pids,
    target_processes,
)
from infra_agent.target.procgroup import OWNER_ENV

pytestmark = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc")

_WINDOW_S = 1.0


@contextmanager
def busy_loop(*, new_session: bool = False, env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A Python ``while True: pass`` in another process, killed on the way out."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=new_session,
                            env={**os.environ, **(env or {})})
    try:
        time.sleep(0.3)  # past the interpreter's start: spinning
        yield proc
    finally:
        proc.kill()
        proc.wait()


def window(*samplers: HostSampler) -> list[HostLoad]:
    for s in samplers:
        s.start()
    time.sleep(_WINDOW_S)
    return [s.stop() for s in samplers]


def test_a_busy_loop_elsewhere_is_foreign_load() -> None:
    with busy_loop():
        (load,) = window(HostSampler())
    assert load.source == "proc" and load.note is None
    assert load.cores == len(os.sched_getaffinity(0))
    assert load.foreign_cpu is not None and load.foreign_cpu > 0.5, load
    assert load.loadavg_start is not None and load.loadavg_end is not None
    assert 0.8 * _WINDOW_S < load.seconds < 10 * _WINDOW_S


def test_quiet_window_reads_less_foreign_load_than_a_busy_one() -> None:
    # Other work on this machine comes and goes: a few tries, one quiet/busy pair in order.
    seen = []
    for _ in range(5):
        (quiet,) = window(HostSampler())
        with busy_loop():
            (busy,) = window(HostSampler())
        assert quiet.foreign_cpu is not None and busy.foreign_cpu is not None
        seen.append((quiet.foreign_cpu, busy.foreign_cpu))
        if quiet.foreign_cpu < busy.foreign_cpu:
            return
    if all(q >= quiet.cores - 0.25 for q, _ in seen):
        pytest.skip(f"other work kept every core busy, so no window was quiet: {seen}")
    pytest.fail(f"a busy loop never raised foreign_cpu above a quiet window's: {seen}")


def _cpu_s(pid: int) -> float:
    """CPU seconds ``pid`` used so far, read independently of the sampler."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_own_processes_are_not_foreign() -> None:
    # The same window, read twice: once with the busy loop as a stranger, once as ours.  How
    # much CPU the loop gets depends on the other work sharing the cores, so the expected
    # shift is what it used, read from its own /proc entry.
    with busy_loop() as proc:
        before = _cpu_s(proc.pid)
        stranger, mine = window(HostSampler(), HostSampler(own_pids=[proc.pid]))
        used = (_cpu_s(proc.pid) - before) / mine.seconds
    assert stranger.foreign_cpu is not None and mine.foreign_cpu is not None and mine.own_cpu is not None
    assert used > 0.05, "the busy loop never ran"
    assert mine.own_cpu > 0.6 * used, (used, mine)  # its CPU went to the experiment
    assert stranger.foreign_cpu - mine.foreign_cpu > 0.6 * used, (used, stranger, mine)


def test_own_process_groups_and_servers_we_launched_are_not_foreign() -> None:
    # One loop in a group of its own, named as the target's group; one that leads its session
    # and carries our launch mark, as ServerProcess starts a server: ours without being named.
    with busy_loop(new_session=True) as grouped, busy_loop(new_session=True, env={OWNER_ENV: f"{os.getpid()}:tok"}) as marked:
        before = {p.pid: _cpu_s(p.pid) for p in (grouped, marked)}
        unnamed, named = window(HostSampler(), HostSampler(own_pgids=[grouped.pid]))
        used = {pid: (_cpu_s(pid) - t) / named.seconds for pid, t in before.items()}
    assert unnamed.own_cpu is not None and named.own_cpu is not None
    assert unnamed.foreign_cpu is not None and named.foreign_cpu is not None
    assert min(used.values()) > 0.05, "a busy loop never ran"
    assert unnamed.own_cpu > 0.6 * used[marked.pid], (used, unnamed)  # found by its mark alone
    assert named.own_cpu - unnamed.own_cpu > 0.6 * used[grouped.pid], (used, unnamed, named)  # and the group's
    assert unnamed.foreign_cpu - named.foreign_cpu > 0.6 * used[grouped.pid], (used, unnamed, named)


def test_without_proc_the_load_average_alone_is_recorded(tmp_path: Path) -> None:
    (load,) = window(HostSampler(proc=tmp_path / "no-proc"))
    assert load.source == "loadavg-only" and load.foreign_cpu is None and load.own_cpu is None
    assert load.loadavg_start is not None and load.loadavg_end is not None
    assert load.note and "load average only" in load.note
    d = load.as_dict()
    assert set(d) == {"loadavg_start", "loadavg_end", "foreign_cpu", "own_cpu", "cores", "seconds", "source", "note"}


def test_host_summary_keeps_the_worst_window() -> None:
    w = [{"scenario": "chat", "index": 0, "loadavg_start": 1.0, "loadavg_end": 1.5, "foreign_cpu": 0.1, "cores": 2,
          "seconds": 1.0, "source": "proc"},
         {"scenario": "chat", "index": 1, "loadavg_start": 1.5, "loadavg_end": 2.0, "foreign_cpu": 0.9, "cores": 2,
          "seconds": 2.0, "source": "proc"}]
    s = host_summary(w)
    assert (s["loadavg_start"], s["loadavg_end"], s["foreign_cpu"], s["seconds"], s["source"]) == (1.0, 2.0, 0.9, 3.0, "proc")
    assert s["windows"] == w
    assert host_summary([{**w[0], "foreign_cpu": None, "source": "loadavg-only", "note": "no /proc"}])["source"] == "loadavg-only"


def test_a_loopback_url_target_counts_its_listening_server(refstack_server) -> None:  # type: ignore[no-untyped-def]
    port = int(refstack_server.url.rsplit(":", 1)[1])
    assert refstack_server.proc.pid in listener_pids(port)

    class Url:
        url, pid = refstack_server.url, None

    pids, groups = target_processes(Url())
    assert refstack_server.proc.pid in pids and refstack_server.proc.pid in groups  # it leads its own session
    Url.url = "http://192.0.2.1:8000"  # not on this machine: nothing of ours
    assert target_processes(Url()) == ([], [])


def test_the_rerun_threshold_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra_agent.target.host_load import default_max_foreign_cpu, parse_max_foreign_cpu

    monkeypatch.delenv("INFRA_AGENT_MAX_FOREIGN_CPU", raising=False)
    assert default_max_foreign_cpu() == 0.5
    monkeypatch.setenv("INFRA_AGENT_MAX_FOREIGN_CPU", "off")
    assert default_max_foreign_cpu() is None
    monkeypatch.setenv("INFRA_AGENT_MAX_FOREIGN_CPU", "1.25")
    assert default_max_foreign_cpu() == 1.25
    assert parse_max_foreign_cpu("OFF") is None and parse_max_foreign_cpu("0.3") == 0.3
    with pytest.raises(ValueError):
        parse_max_foreign_cpu("-1")
