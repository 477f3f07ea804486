"""Thread states from py-spy dump snapshots: every thread, every state, and the thread_blocked finding.

The dumps are synthetic (written as ``PySpyDumpSampler`` writes them), the source files
they point at are real files, since a C call such as ``time.sleep`` leaves no frame and
its kind is read from the caller's line.
"""

from __future__ import annotations

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

from .synth_dumps import (
    AWAIT_LINE,
    COMPUTE_LINE,
    GET_LINE,
    LIB,
    LOCK_LINE,
    SLEEP_LINE,
    WITH_LINE,
    app_file,
    asyncio_server,
    frame,
    loop_under,
    thread,
    thread_under,
    write_dumps,
)


def test_a_blocked_event_loop_is_a_finding_naming_the_call_site_and_who_ran(tmp_path: Path) -> None:
    app = app_file(tmp_path)
    tl = load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", asyncio_server(app, blocking=True)))
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
    app = app_file(tmp_path)
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", asyncio_server(app, blocking=False))))
    loop = report.thread_states.thread("MainThread")  # type: ignore[union-attr]
    assert loop is not None and loop.shares == {"idle": 1.0} and loop.blocked_share == 0.0
    worker = report.thread_states.thread("worker")  # type: ignore[union-attr]
    # the worker holds the GIL three snapshots in five and is parked on a plain line the rest
    assert worker is not None and worker.role is None and abs(worker.shares["running"] - 0.6) < 0.03
    assert not [f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED]


def _mostly_idle_loop(app: str, blocking: bool, n: int = 80) -> list[list[dict[str, Any]]]:
    """A loop in its selector most of the window (its engine is slow, as on a loaded machine): one
    snapshot in ten in its handler's time.sleep (blocking) or in the selector too (clean), one in
    twenty running its handler."""
    out = []
    for i in range(n):
        if i % 10 == 0 and blocking:
            loop = thread("MainThread", 1, loop_under(app, frame("handle", app, SLEEP_LINE)))
        elif i % 20 == 1:
            loop = thread("MainThread", 1, loop_under(app, frame("handle", app, AWAIT_LINE)), gil=True, active=True)
        else:
            loop = thread("MainThread", 1, loop_under(app, frame("EpollSelector.select", f"{LIB}/selectors.py", 468)))
        out.append([loop])
    return out


def test_a_fixed_blocking_call_is_measured_against_the_loops_own_time(tmp_path: Path) -> None:
    # A tenth of the window in time.sleep, under the 20% of the window a blocked share needs; but
    # two thirds of the loop's own time (its selector left out), as when a loaded machine slows
    # the engine and the loop waits longer between requests: the finding, with both shares.
    app = app_file(tmp_path)
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", _mostly_idle_loop(app, True))))
    loop = report.thread_states.thread("MainThread")  # type: ignore[union-attr]
    assert loop is not None and abs(loop.blocked_share - 0.1) < 0.02, loop.shares
    assert abs(loop.own_blocked_share - 8 / 12) < 0.05, loop.shares
    found = [f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert len(found) == 1 and found[0].location is not None, [f.message for f in found]
    assert (found[0].location.line, found[0].evidence["kind"]) == (SLEEP_LINE, "sleep")
    assert "10% of the sampled window (67% of its own time" in found[0].message, found[0].message
    # The clean loop: all selector and a little running, no finding.
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "c.jsonl", _mostly_idle_loop(app, False))))
    assert not [f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED]


def _sample(frames: list[dict[str, Any]], gil: bool = False, active: bool = False, thread: str = "t") -> Sample:
    return Sample(0.0, thread, tuple(Frame(f["name"], f["filename"], f["line"]) for f in reversed(frames)),
                  holds_gil=gil, idle=not active, snapshot=True)


def test_each_kind_of_wait_and_its_call_site(tmp_path: Path) -> None:
    app = app_file(tmp_path)
    owner = _sample(thread_under("compute", app, COMPUTE_LINE), gil=True, thread="other")
    cond = frame("Condition.wait", f"{LIB}/threading.py", 327)
    get = frame("Queue.get", f"{LIB}/queue.py", 171)
    cases = [
        # a queue get below the thread's loop is a wait in the thread's work: blocked, at the caller
        (thread_under("loop", app, 30, cond, get, frame("step", app, GET_LINE)), False, None,
         ("blocked", "queue", "step", f"{app}:{GET_LINE}", "Queue.get")),
        # the same get made by the thread's target itself: a worker waiting for work (idle)
        (thread_under("step", app, GET_LINE, cond, get), False, None,
         ("idle", "queue", "step", f"{app}:{GET_LINE}", "Queue.get")),
        # a C lock leaves no frame: the caller's line says what it waits on
        (thread_under("loop", app, 30, frame("guarded", app, LOCK_LINE)), False, None,
         ("blocked", "lock", "guarded", f"{app}:{LOCK_LINE}", "self._lock")),
        # any C context manager entered on the line, while another thread holds the GIL: still the lock
        (thread_under("loop", app, 30, frame("submit", app, WITH_LINE)), False, owner,
         ("blocked", "lock", "submit", f"{app}:{WITH_LINE}", "self._wake")),
        (thread_under("loop", app, 30, frame("SocketIO.readinto", f"{LIB}/socket.py", 706), frame("step", app, 11)),
         False, None, ("blocked", "socket", "step", f"{app}:11", "SocketIO.readinto")),
        (thread_under("loop", app, 30, frame("Popen._try_wait", f"{LIB}/subprocess.py", 2004),
                       frame("Popen.wait", f"{LIB}/subprocess.py", 1264), frame("step", app, 11)),
         False, None, ("blocked", "subprocess", "step", f"{app}:11", "Popen.wait")),
        # parked on a plain line while another thread owns the GIL: waiting for it
        (thread_under("compute", app, COMPUTE_LINE), False, owner, ("gil_wait", None, "compute", f"{app}:{COMPUTE_LINE}", None)),
        # ... while nobody owns it: parked in some native call
        (thread_under("compute", app, COMPUTE_LINE), False, None, ("blocked", "other", "compute", f"{app}:{COMPUTE_LINE}", None)),
        # on a CPU without the GIL: native code that released it
        (thread_under("compute", app, COMPUTE_LINE), True, owner, ("native", None, "compute", f"{app}:{COMPUTE_LINE}", None)),
    ]
    for frames, active, own, want in cases:
        st = classify(_sample(frames, active=active), own, loop=False)
        assert (st.state, st.kind, st.function, st.where, st.waits_in) == want, (frames[0], st)


def test_uvloop_rests_below_its_run_call_and_an_awaiting_line_never_blocks(tmp_path: Path) -> None:
    app = app_file(tmp_path)
    uv = [frame("run", "/site-packages/uvloop/__init__.py", 109), frame("<module>", app, 20)]
    idle = classify(_sample(uv), None, loop=True)
    assert idle.state == "idle"
    handler = classify(_sample([frame("handle", app, SLEEP_LINE), *uv]), None, loop=True)
    assert (handler.state, handler.kind, handler.waits_in) == ("blocked", "sleep", "time.sleep")
    # a coroutine on the stack at an await runs (it is not parked in the call)
    awaiting = classify(_sample([frame("handle", app, AWAIT_LINE), *uv]), None, loop=True)
    assert (awaiting.state, awaiting.kind) == ("blocked", "other")
    # asyncio's transports write to non-blocking sockets: parked there is no wait on the peer
    write = classify(_sample(loop_under(app, frame("_SelectorSocketTransport.write",
                                                   f"{LIB}/asyncio/selector_events.py", 1057))), None, loop=True)
    assert (write.state, write.kind) == ("blocked", "other")
    # the event loop's own Condition wait is no rest for it: only its selector is
    cond = classify(_sample(loop_under(app, frame("Condition.wait", f"{LIB}/threading.py", 327),
                                        frame("step", app, GET_LINE))), None, loop=True)
    assert (cond.state, cond.kind, cond.function) == ("blocked", "lock", "step")


def test_a_named_serving_thread_blocked_on_a_lock_is_a_finding_a_quiet_one_is_not(tmp_path: Path) -> None:
    app = app_file(tmp_path)
    cond = frame("Condition.wait", f"{LIB}/threading.py", 327)
    get = frame("Queue.get", f"{LIB}/queue.py", 171)
    snaps = []
    for i in range(20):
        locked = i % 2 == 0
        out = thread_under("loop", app, 30, frame("guarded", app, LOCK_LINE)) if locked else \
            thread_under("step", app, GET_LINE, cond, get)
        snaps.append([thread("detokenizer-0", 5, out),
                      thread("tokenizer", 6, thread_under("step", app, GET_LINE, cond, get)),
                      thread("engine", 7, thread_under("compute", app, COMPUTE_LINE), gil=True, active=True)])
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", snaps)))
    found = [f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert [f.location.thread for f in found if f.location] == ["detokenizer-0"]
    assert found[0].evidence["kind"] == "lock" and found[0].evidence["role"] == "detokenizer"
    assert found[0].evidence["meanwhile_thread"] == "engine" and abs(found[0].evidence["blocked_share"] - 0.5) < 0.05
    tok = report.thread_states.thread("tokenizer")  # type: ignore[union-attr]
    assert tok is not None and tok.role == "tokenizer" and tok.shares == {"idle": 1.0}


def test_the_blocked_loop_explains_a_bursty_stream_before_nagle(tmp_path: Path) -> None:
    app = app_file(tmp_path)
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", asyncio_server(app, blocking=True))))
    bursty = Finding(kind=FindingKind.BURSTY_STREAM, severity="warning", message="80% of inter-token gaps are short",
                     location=Location(component="server"), evidence={"short_share": 0.8},
                     next_question="Is Nagle's algorithm on for the server's connections?")
    findings = [bursty, *timeline_feedback(report).findings]
    explain_bursts(findings)
    explain_bursts(findings)  # once only
    q = bursty.next_question or ""
    assert q.index("MainThread") < q.index("Nagle") and q.count("Only if bursts remain") == 1
    assert f"{app}:{SLEEP_LINE}" in bursty.message and bursty.evidence["blocked_thread"] == "MainThread"
    clean = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "c.jsonl", asyncio_server(app, blocking=False))))
    plain = bursty.model_copy(deep=True, update={"evidence": {"short_share": 0.8},
                                                 "next_question": "Is Nagle's algorithm on?"})
    explain_bursts([plain, *timeline_feedback(clean).findings])
    assert plain.next_question == "Is Nagle's algorithm on?"


def test_thread_states_with_spans_name_the_span_and_chrometrace_says_why_there_are_none(tmp_path: Path) -> None:
    from .synth import MAIN, case_b_spans, write

    app = app_file(tmp_path)
    # MainThread (tid MAIN) parked on a lock inside ep.dispatch [1000, 3000] µs
    snaps = [[thread("MainThread", MAIN, thread_under("loop", app, 30, frame("guarded", app, LOCK_LINE)))]
             for _ in range(5)]
    tl = load_timeline([write(tmp_path / "s.json", case_b_spans())],
                       pyspy=write_dumps(tmp_path / "d.jsonl", snaps, every_us=400, start_us=1100))
    main = thread_states(tl).thread("MainThread")
    assert main is not None and main.blocked_sites()[0].span == "ep.dispatch"
    chrome = thread_states(type(tl)(samples=[Sample(0.0, "MainThread", (), holds_gil=True)], sampled_window=(0.0, 1.0)))
    assert chrome.threads == [] and "dump" in (chrome.note or "")
