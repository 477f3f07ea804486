"""Thread states of a real asyncio server sampled with the project's py-spy dump sampler.

The server (``blocking_server.py``) has no spans: the analysis works from py-spy alone,
as it does on a server we did not write.  With ``--blocking`` its handler calls
``time.sleep`` on the loop thread: the finding names that thread, the sleep and the
handler's line.  Without it the loop waits in its selector: idle, no finding.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from infra_agent.feedback import Finding
from infra_agent.trace.analyze import TimelineReport, analyze
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import load_timeline
from infra_agent.trace.sampler import GIVE_UP_BEFORE_FIRST_SAMPLE, PySpyDumpSampler
from infra_agent.vocabulary import FindingKind

HERE = Path(__file__).parent
SERVER = HERE / "blocking_server.py"
CLIENTS = 4
MIN_DUMPS = 12


def _pyspy_works() -> bool:
    try:
        return subprocess.run(["py-spy", "--version"], capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _sampled(tmp_path: Path, blocking: bool) -> tuple[TimelineReport, list[Finding]]:
    """Sample the server while CLIENTS threads send requests; the report and its findings."""
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

        clients = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        for c in clients:
            c.start()
        sampler = PySpyDumpSampler(proc.pid, tmp_path / "dumps.jsonl").start()
        deadline = time.monotonic() + 60
        while sampler.samples < MIN_DUMPS and time.monotonic() < deadline and not (
                sampler.samples == 0 and sampler.failures >= GIVE_UP_BEFORE_FIRST_SAMPLE):  # refused: it gave up
            time.sleep(0.1)
        res = sampler.stop()
        stop.set()
        for c in clients:
            c.join(30)
    finally:
        proc.kill()
        proc.wait(10)
    if res.path is None:
        pytest.skip(f"py-spy could not attach here: {res.warning}")
    assert served and set(served) == {200}
    report = analyze(load_timeline([], pyspy=res.path))
    return report, timeline_feedback(report).findings


@pytest.mark.skipif(not _pyspy_works(), reason="py-spy is not installed")
def test_a_handler_that_sleeps_on_the_loop_is_named_with_its_line(tmp_path: Path) -> None:
    _, findings = _sampled(tmp_path, blocking=True)
    line = next(i for i, t in enumerate(SERVER.read_text().splitlines(), 1) if "BLOCKS_THE_LOOP" in t)
    blocked = [f for f in findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert len(blocked) == 1, [f.message for f in findings]
    f = blocked[0]
    assert f.location is not None and f.location.thread == "MainThread" and f.evidence["role"] == "event loop"
    assert f.evidence["kind"] == "sleep" and f.evidence["waits_in"] == "time.sleep"
    assert (f.location.file, f.location.line) == (str(SERVER), line) and f"{SERVER}:{line}" in f.message
    assert f.evidence["function"] == "handle"


@pytest.mark.skipif(not _pyspy_works(), reason="py-spy is not installed")
def test_a_loop_that_awaits_is_idle_in_its_selector(tmp_path: Path) -> None:
    report, findings = _sampled(tmp_path, blocking=False)
    assert not [f for f in findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert report.thread_states is not None
    loop = report.thread_states.thread("MainThread")
    assert loop is not None and loop.role == "event loop" and loop.samples >= MIN_DUMPS
    # the loop rests in its selector most of the time; a sleep on it is never seen
    assert loop.shares.get("idle", 0.0) > 0.5 and "blocked:sleep" not in loop.shares, loop.shares
