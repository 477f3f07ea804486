"""Event-loop stalls: a real asyncio server recorded with ``py-spy record``, and stalls lined up with requests.

The server (``blocking_server.py``, no spans) is recorded the way the timeline probe
records one: every thread at 200 Hz, idle ones too, without pausing it.  With
``--blocking`` each request holds the loop in ``time.sleep`` for 20 ms: the stalls are
that long and their call site is the handler's line.  Without it the loop awaits, and no
stall sits in a sleep.  The lining up with requests runs on results written as the
serving client writes them.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from infra_agent.serving.client import RequestRecord
from infra_agent.serving.metrics import compute_metrics
from infra_agent.trace.loop_stall_finding import loop_stall_feedback
from infra_agent.trace.loop_stalls import (
    LoopStalls,
    Stall,
    StallSite,
    loop_stalls,
    tail_shares,
)
from infra_agent.trace.sampler import PySpyRecorder
from infra_agent.vocabulary import FindingKind

HERE = Path(__file__).parent
SERVER = HERE / "blocking_server.py"
CLIENTS = 2
RATE = 200
THINK_S = 0.05  # between a client's requests: the loop rests in its selector between stalls


def _pyspy_works() -> bool:
    try:
        return subprocess.run(["py-spy", "--version"], capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _recorded(tmp_path: Path, blocking: bool, seconds: float = 3.0) -> list[LoopStalls]:
    proc = subprocess.Popen([sys.executable, str(SERVER), *(["--blocking"] if blocking else [])],
                            stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    served: list[int] = []
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}/"

        def client() -> None:
            while not stop.is_set():
                with urllib.request.urlopen(url, timeout=30) as r:
                    served.append(r.status)
                stop.wait(THINK_S)

        clients = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        for c in clients:
            c.start()
        rec = PySpyRecorder(proc.pid, tmp_path / "record.json", rate=RATE, gil=False, idle=True,
                            nonblocking=True).start()
        time.sleep(seconds)
        res = rec.stop()
        stop.set()
        for c in clients:
            c.join(30)
    finally:
        proc.kill()
        proc.wait(10)
    if res.path is None:
        pytest.skip(f"py-spy could not attach here: {res.warning}")
    assert served and set(served) == {200}
    return loop_stalls(res.path, res.start_unix_ns, RATE)


@pytest.mark.skipif(not _pyspy_works(), reason="py-spy is not installed")
def test_a_loop_that_sleeps_stalls_as_long_as_the_sleep_at_the_handlers_line(tmp_path: Path) -> None:
    loops = _recorded(tmp_path, blocking=True)
    assert len(loops) == 1, [ls.to_dict() for ls in loops]  # the main thread (py-spy 0.4 names it by its id)
    ls = loops[0]
    line = next(i for i, t in enumerate(SERVER.read_text().splitlines(), 1) if "BLOCKS_THE_LOOP" in t)
    # Each request sleeps 20 ms on the loop; measured to a 5 ms sampling interval, stalls are at
    # least 10 ms (on a loaded machine a starved server joins many into one: longer, not shorter).
    assert ls.stalls and ls.pct(50) >= 10.0, ls.to_dict()
    for top in (ls.time_sites()[0], ls.top_sites()[0]):  # most stalled time, and the longest stalls
        assert (top["function"], top["where"], top["kind"], top["waits_in"]) == (
            "handle", f"{SERVER}:{line}", "sleep", "time.sleep"), ls.to_dict()
    assert ls.zero_unix_ns is not None and abs(ls.zero_unix_ns / 1e9 - time.time()) < 600


@pytest.mark.skipif(not _pyspy_works(), reason="py-spy is not installed")
def test_a_loop_that_awaits_has_no_stall_in_a_sleep(tmp_path: Path) -> None:
    loops = _recorded(tmp_path, blocking=False)
    for ls in loops:
        assert not [s for s in ls.stalls if s.site is not None and s.site.kind == "sleep"], ls.to_dict()


def _result(starts: list[float], ttfts: list[float], itl_s: float = 0.01, tokens: int = 4) -> dict[str, object]:
    recs = []
    t0 = time.perf_counter()
    for s, t in zip(starts, ttfts, strict=True):
        r = RequestRecord(prompt_len=8, output_len=tokens, success=True)
        r.start, r.ttft, r.itl = t0 + s, t, [itl_s] * (tokens - 1)
        r.latency = t + itl_s * (tokens - 1)
        recs.append(r)
    return compute_metrics(recs, duration=10.0)


def test_start_times_are_unix_seconds_in_send_order() -> None:
    res = _result([0.0, 0.5, 1.0], [0.1, 0.1, 0.1])
    st = res["start_times"]
    assert isinstance(st, list) and abs(st[0] - time.time()) < 60
    assert abs((st[1] - st[0]) - 0.5) < 1e-6 and abs((st[2] - st[0]) - 1.0) < 1e-6


def test_stalls_inside_the_slow_requests_explain_the_ttft_tail() -> None:
    # 20 requests 1 s apart; two of them (the tail) have a 300 ms TTFT, the rest 50 ms.
    starts = [float(i) for i in range(20)]
    ttfts = [0.3 if i in (5, 12) else 0.05 for i in range(20)]
    res = _result(starts, ttfts)
    z = res["start_times"][0]  # type: ignore[index]
    # A 200 ms stall at the start of each slow request; none elsewhere.
    stalls = [(z + 5.0, z + 5.2), (z + 12.0, z + 12.2)]
    ttft = next(t for t in tail_shares(res, stalls) if t.metric == "ttft")
    assert ttft.count == 2 and 50.0 < ttft.threshold_ms <= 300.0  # interpolated between the two groups
    assert abs(ttft.stalled_share - 0.2 / 0.3) < 1e-6 and ttft.rest_share == 0.0


def _loop(stalls: list[tuple[float, float, StallSite]], zero_s: float) -> LoopStalls:
    """A loop thread's stalls as ``stalls_of`` makes them: (start s, ms, site), one site each."""
    ls = LoopStalls("MainThread", int(zero_s * 1e9), (0.0, 20e6), 5.0)
    for t, ms, site in sorted(stalls, key=lambda x: x[0]):
        ls.stalls.append(Stall(t * 1e6, t * 1e6 + ms * 1e3, site))
        ls.segments.append((t * 1e6, t * 1e6 + ms * 1e3, site))
        ls.site_us[site] = ls.site_us.get(site, 0.0) + ms * 1e3
    return ls


def test_the_finding_names_a_blocking_call_that_explains_a_tail_and_leaves_running_loops_as_info() -> None:
    starts = [float(i) for i in range(20)]
    ttfts = [0.3 if i in (5, 12) else 0.05 for i in range(20)]
    res = _result(starts, ttfts)
    z = res["start_times"][0]  # type: ignore[index]
    site = StallSite("audit", "/srv/app.py:42", "sleep", "time.sleep")
    other = StallSite("encode", "/srv/app.py:7", "running")
    # 200 ms in a sleep inside each slow request; a 5 ms callback in every second.
    short = [(t + 0.5, 5.0, other) for t in range(20)]
    findings, measurements, summary = loop_stall_feedback([_loop([(5.0, 200.0, site), (12.0, 200.0, site), *short], z)],
                                                          res, {"scenario": "chat"})
    assert [f.severity for f in findings] == ["warning"], [f.message for f in findings]
    f = findings[0]
    assert f.kind == FindingKind.LOOP_STALLS and f.location is not None
    assert (f.location.function, f.location.file, f.location.line) == ("audit", "/srv/app.py", 42)
    assert f.evidence["explains"] == "ttft" and abs(f.evidence["tail_share"] - 0.2 / 0.3) < 1e-3
    assert "TTFT tail" in f.message and "time.sleep" in f.message
    assert measurements[0].name == "loop_stall_ms" and len(measurements[0].samples) == 22
    assert summary[0]["max_ms"] == 200.0
    # The same stalls spent running Python (the loop's work, or a machine short of CPU): info.
    busy = StallSite("render", "/srv/app.py:9", "running")
    findings, _, _ = loop_stall_feedback([_loop([(5.0, 200.0, busy), (12.0, 200.0, busy), *short], z)], res, {})
    assert [f.severity for f in findings] == ["info"], [f.message for f in findings]
    # A sleep on the loop that no tail request or gap overlaps: info too.
    findings, _, _ = loop_stall_feedback([_loop([(2.5, 200.0, site), (9.5, 200.0, site), *short], z)], res, {})
    assert [f.severity for f in findings] == ["info"], [f.message for f in findings]
