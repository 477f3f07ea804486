"""Thread states from py-spy dump snapshots: every thread, every state, and the thread_blocked finding.

The dumps are synthetic (written as ``PySpyDumpSampler`` writes them), the source files
they point at are real files, since a C call such as ``time.sleep`` leaves no frame and
its kind is read from the caller's line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infra_agent.feedback import Finding, Location
from infra_agent.trace.analyze import analyze
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import load_timeline
from infra_agent.trace.model import Frame, Sample
from infra_agent.trace.thread_blocked import explain_bursts
from infra_agent.trace.thread_states import classify, thread_states
from infra_agent.vocabulary import FindingKind

from .synth import ORIGIN_NS

LIB = "/usr/lib/python3.11"
APP = """\
import asyncio, queue, threading, time

async def handle(reader, writer):
    time.sleep(0.05)
    await asyncio.sleep(0.05)

def compute(n):
    return sum(i * i for i in range(n))

def step(q):
    return q.get()

def guarded(self):
    with self._lock:
        pass
"""
SLEEP_LINE, AWAIT_LINE, COMPUTE_LINE, GET_LINE, LOCK_LINE = 4, 5, 8, 11, 14


def _app(tmp_path: Path) -> str:
    path = tmp_path / "app.py"
    path.write_text(APP)
    return str(path)


def _f(name: str, file: str, line: int) -> dict[str, Any]:
    return {"name": name, "filename": file, "line": line}


def _loop_under(app: str, *inner: dict[str, Any]) -> list[dict[str, Any]]:
    """An asyncio.run() stack, innermost first as py-spy writes it, with ``inner`` on top."""
    return [*inner,
            _f("BaseEventLoop._run_once", f"{LIB}/asyncio/base_events.py", 1922),
            _f("BaseEventLoop.run_forever", f"{LIB}/asyncio/base_events.py", 607),
            _f("BaseEventLoop.run_until_complete", f"{LIB}/asyncio/base_events.py", 640),
            _f("Runner.run", f"{LIB}/asyncio/runners.py", 118), _f("run", f"{LIB}/asyncio/runners.py", 190),
            _f("<module>", app, 20)]


def _thread_under(target: str, app: str, line: int, *inner: dict[str, Any]) -> list[dict[str, Any]]:
    return [*inner, _f(target, app, line), _f("Thread.run", f"{LIB}/threading.py", 982),
            _f("Thread._bootstrap_inner", f"{LIB}/threading.py", 1045),
            _f("Thread._bootstrap", f"{LIB}/threading.py", 1002)]


def _th(name: str, tid: int, frames: list[dict[str, Any]], gil: bool = False, active: bool = False) -> dict[str, Any]:
    return {"thread_name": name, "os_thread_id": tid, "owns_gil": gil, "active": active, "frames": frames}


def _write(path: Path, snapshots: list[list[dict[str, Any]]], every_us: int = 10_000, start_us: int = 0) -> Path:
    path.write_text("".join(json.dumps({"ts_unix_ns": ORIGIN_NS + (start_us + i * every_us) * 1000, "threads": threads})
                            + "\n"
                            for i, threads in enumerate(snapshots)))
    return path


def _server(app: str, blocking: bool, n: int = 40) -> list[list[dict[str, Any]]]:
    """An asyncio server's loop thread and a worker thread.  Three snapshots in five the loop is
    in its handler's time.sleep (blocking) or awaits asyncio.sleep, idle in the selector (clean);
    meanwhile the worker holds the GIL in compute()."""
    out = []
    for i in range(n):
        busy = i % 5 < 3
        if busy and blocking:
            loop = _loop_under(app, _f("handle", app, SLEEP_LINE), _f("Handle._run", f"{LIB}/asyncio/events.py", 80))
        else:
            loop = _loop_under(app, _f("EpollSelector.select", f"{LIB}/selectors.py", 468))
        out.append([_th("MainThread", 1, loop),
                    _th("worker", 2, _thread_under("compute", app, COMPUTE_LINE), gil=busy, active=busy)])
    return out


def test_a_blocked_event_loop_is_a_finding_naming_the_call_site_and_who_ran(tmp_path: Path) -> None:
    app = _app(tmp_path)
    tl = load_timeline([], pyspy=_write(tmp_path / "d.jsonl", _server(app, blocking=True)))
    report = analyze(tl)
    states = report.thread_states
    assert states is not None and states.snapshots == 40
    loop = states.thread("MainThread")
    assert loop is not None and loop.role == "event loop" and loop.samples == 40
    # 24 of 40 snapshots in time.sleep; the first and last stand for half an interval each
    assert abs(loop.shares["blocked:sleep"] - 24 / 40) < 0.03 and abs(loop.shares["idle"] - 16 / 40) < 0.03
    site = loop.blocked_sites()[0]
    assert (site.function, site.where, site.waits_in) == ("handle", f"{app}:{SLEEP_LINE}", "time.sleep")
    assert site.meanwhile is not None and site.meanwhile["thread"] == "worker"
    assert site.meanwhile["where"] == f"{app}:{COMPUTE_LINE}" and site.meanwhile["how"] == "held the GIL"
    fb = timeline_feedback(report)
    found = [f for f in fb.findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert len(found) == 1, fb.render_text()
    f = found[0]
    assert f.severity == "warning" and f.location is not None
    assert (f.location.thread, f.location.file, f.location.line) == ("MainThread", app, SLEEP_LINE)
    assert "sleep" in f.message and "time.sleep" in f.message and "worker held the GIL" in f.message
    assert "run_in_executor" in (f.next_question or "")
    blocked = [m for m in fb.measurements if m.name == "thread_blocked_share" and m.tags.get("thread") == "MainThread"]
    assert blocked and abs(blocked[0].samples[0] - loop.blocked_share) < 1e-9


def test_a_loop_waiting_in_its_selector_is_idle_not_blocked(tmp_path: Path) -> None:
    app = _app(tmp_path)
    report = analyze(load_timeline([], pyspy=_write(tmp_path / "d.jsonl", _server(app, blocking=False))))
    loop = report.thread_states.thread("MainThread")  # type: ignore[union-attr]
    assert loop is not None and loop.shares == {"idle": 1.0} and loop.blocked_share == 0.0
    worker = report.thread_states.thread("worker")  # type: ignore[union-attr]
    # the worker holds the GIL three snapshots in five and is parked on a plain line the rest
    assert worker is not None and worker.role is None and abs(worker.shares["running"] - 0.6) < 0.03
    assert not [f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED]


def _sample(frames: list[dict[str, Any]], gil: bool = False, active: bool = False, thread: str = "t") -> Sample:
    return Sample(0.0, thread, tuple(Frame(f["name"], f["filename"], f["line"]) for f in reversed(frames)),
                  holds_gil=gil, idle=not active, snapshot=True)


def test_each_kind_of_wait_and_its_call_site(tmp_path: Path) -> None:
    app = _app(tmp_path)
    owner = _sample(_thread_under("compute", app, COMPUTE_LINE), gil=True, thread="other")
    cond = _f("Condition.wait", f"{LIB}/threading.py", 327)
    get = _f("Queue.get", f"{LIB}/queue.py", 171)
    cases = [
        # a queue get below the thread's loop is a wait in the thread's work: blocked, at the caller
        (_thread_under("loop", app, 30, cond, get, _f("step", app, GET_LINE)), False, None,
         ("blocked", "queue", "step", f"{app}:{GET_LINE}", "Queue.get")),
        # the same get made by the thread's target itself: a worker waiting for work (idle)
        (_thread_under("step", app, GET_LINE, cond, get), False, None,
         ("idle", "queue", "step", f"{app}:{GET_LINE}", "Queue.get")),
        # a C lock leaves no frame: the caller's line says what it waits on
        (_thread_under("loop", app, 30, _f("guarded", app, LOCK_LINE)), False, None,
         ("blocked", "lock", "guarded", f"{app}:{LOCK_LINE}", "self._lock")),
        (_thread_under("loop", app, 30, _f("SocketIO.readinto", f"{LIB}/socket.py", 706), _f("step", app, 11)),
         False, None, ("blocked", "socket", "step", f"{app}:11", "SocketIO.readinto")),
        (_thread_under("loop", app, 30, _f("Popen._try_wait", f"{LIB}/subprocess.py", 2004),
                       _f("Popen.wait", f"{LIB}/subprocess.py", 1264), _f("step", app, 11)),
         False, None, ("blocked", "subprocess", "step", f"{app}:11", "Popen.wait")),
        # parked on a plain line while another thread owns the GIL: waiting for it
        (_thread_under("compute", app, COMPUTE_LINE), False, owner, ("gil_wait", None, "compute", f"{app}:{COMPUTE_LINE}", None)),
        # ... while nobody owns it: parked in some native call
        (_thread_under("compute", app, COMPUTE_LINE), False, None, ("blocked", "other", "compute", f"{app}:{COMPUTE_LINE}", None)),
        # on a CPU without the GIL: native code that released it
        (_thread_under("compute", app, COMPUTE_LINE), True, owner, ("native", None, "compute", f"{app}:{COMPUTE_LINE}", None)),
    ]
    for frames, active, own, want in cases:
        st = classify(_sample(frames, active=active), own, loop=False)
        assert (st.state, st.kind, st.function, st.where, st.waits_in) == want, (frames[0], st)


def test_uvloop_rests_below_its_run_call_and_an_awaiting_line_never_blocks(tmp_path: Path) -> None:
    app = _app(tmp_path)
    uv = [_f("run", "/site-packages/uvloop/__init__.py", 109), _f("<module>", app, 20)]
    idle = classify(_sample(uv), None, loop=True)
    assert idle.state == "idle"
    handler = classify(_sample([_f("handle", app, SLEEP_LINE), *uv]), None, loop=True)
    assert (handler.state, handler.kind, handler.waits_in) == ("blocked", "sleep", "time.sleep")
    # a coroutine on the stack at an await runs (it is not parked in the call)
    awaiting = classify(_sample([_f("handle", app, AWAIT_LINE), *uv]), None, loop=True)
    assert (awaiting.state, awaiting.kind) == ("blocked", "other")
    # the event loop's own Condition wait is no rest for it: only its selector is
    cond = classify(_sample(_loop_under(app, _f("Condition.wait", f"{LIB}/threading.py", 327),
                                        _f("step", app, GET_LINE))), None, loop=True)
    assert (cond.state, cond.kind, cond.function) == ("blocked", "lock", "step")


def test_a_named_serving_thread_blocked_on_a_lock_is_a_finding_a_quiet_one_is_not(tmp_path: Path) -> None:
    app = _app(tmp_path)
    cond = _f("Condition.wait", f"{LIB}/threading.py", 327)
    get = _f("Queue.get", f"{LIB}/queue.py", 171)
    snaps = []
    for i in range(20):
        locked = i % 2 == 0
        out = _thread_under("loop", app, 30, _f("guarded", app, LOCK_LINE)) if locked else \
            _thread_under("step", app, GET_LINE, cond, get)
        snaps.append([_th("detokenizer-0", 5, out),
                      _th("tokenizer", 6, _thread_under("step", app, GET_LINE, cond, get)),
                      _th("engine", 7, _thread_under("compute", app, COMPUTE_LINE), gil=True, active=True)])
    report = analyze(load_timeline([], pyspy=_write(tmp_path / "d.jsonl", snaps)))
    found = [f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert [f.location.thread for f in found if f.location] == ["detokenizer-0"]
    assert found[0].evidence["kind"] == "lock" and found[0].evidence["role"] == "detokenizer"
    assert found[0].evidence["meanwhile_thread"] == "engine" and abs(found[0].evidence["blocked_share"] - 0.5) < 0.05
    tok = report.thread_states.thread("tokenizer")  # type: ignore[union-attr]
    assert tok is not None and tok.role == "tokenizer" and tok.shares == {"idle": 1.0}


def test_the_blocked_loop_explains_a_bursty_stream_before_nagle(tmp_path: Path) -> None:
    app = _app(tmp_path)
    report = analyze(load_timeline([], pyspy=_write(tmp_path / "d.jsonl", _server(app, blocking=True))))
    bursty = Finding(kind=FindingKind.BURSTY_STREAM, severity="warning", message="80% of inter-token gaps are short",
                     location=Location(component="server"), evidence={"short_share": 0.8},
                     next_question="Is Nagle's algorithm on for the server's connections?")
    findings = [bursty, *timeline_feedback(report).findings]
    explain_bursts(findings)
    explain_bursts(findings)  # once only
    q = bursty.next_question or ""
    assert q.index("MainThread") < q.index("Nagle") and q.count("Only if bursts remain") == 1
    assert f"{app}:{SLEEP_LINE}" in bursty.message and bursty.evidence["blocked_thread"] == "MainThread"
    clean = analyze(load_timeline([], pyspy=_write(tmp_path / "c.jsonl", _server(app, blocking=False))))
    plain = bursty.model_copy(deep=True, update={"evidence": {"short_share": 0.8},
                                                 "next_question": "Is Nagle's algorithm on?"})
    explain_bursts([plain, *timeline_feedback(clean).findings])
    assert plain.next_question == "Is Nagle's algorithm on?"


def test_thread_states_with_spans_name_the_span_and_chrometrace_says_why_there_are_none(tmp_path: Path) -> None:
    from .synth import MAIN, case_b_spans, write

    app = _app(tmp_path)
    # MainThread (tid MAIN) parked on a lock inside ep.dispatch [1000, 3000] µs
    snaps = [[_th("MainThread", MAIN, _thread_under("loop", app, 30, _f("guarded", app, LOCK_LINE)))]
             for _ in range(5)]
    tl = load_timeline([write(tmp_path / "s.json", case_b_spans())],
                       pyspy=_write(tmp_path / "d.jsonl", snaps, every_us=400, start_us=1100))
    main = thread_states(tl).thread("MainThread")
    assert main is not None and main.blocked_sites()[0].span == "ep.dispatch"
    chrome = thread_states(type(tl)(samples=[Sample(0.0, "MainThread", (), holds_gil=True)], sampled_window=(0.0, 1.0)))
    assert chrome.threads == [] and "dump" in (chrome.note or "")
