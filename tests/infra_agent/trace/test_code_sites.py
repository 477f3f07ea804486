"""Findings that name the function: a lock's holder, the code behind a growing span and behind a
step's untraced part, the code whose allocations start the collector, on constructed timelines
(synthetic py-spy dumps over real source files, spans as our tracer writes them)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

import infra_agent.tracing.recorder as rec
from infra_agent.feedback import Location
from infra_agent.trace.analyze import analyze
from infra_agent.trace.code_sites import code_frame, is_plumbing
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import load_timeline
from infra_agent.trace.model import Frame
from infra_agent.tracing.recorder import Tracer
from infra_agent.vocabulary import FindingKind

from .synth import MAIN, ours, write
from .synth_dumps import LIB, frame, loop_under, thread, thread_under, write_dumps

ENGINE = """\
class Engine:
    def add_request(self, req):
        with self._wake:
            self._inbox.append(req)

    def _forward(self, chunks):
        with self._lock:
            return self._run_model(chunks)

    def _loop(self):
        while True:
            self.step()

    def step(self):
        self._forward([])
        self._sample([])
        self._journal([])
"""
WAKE_LINE, HELD_LINE, STEP_CALL_LINE = 3, 8, 12


def _engine(tmp_path: Path) -> str:
    path = tmp_path / "engine.py"
    path.write_text(ENGINE)
    return str(path)


def test_plumbing_frames_are_skipped_for_the_code_that_called_them() -> None:
    app = Frame("Engine._journal", "/srv/app/engine.py", 30)
    json_frame = Frame("JSONEncoder.iterencode", "/usr/lib/python3.11/json/encoder.py", 258)
    genexpr = Frame("Engine._sample.<locals>.<genexpr>", "/srv/app/engine.py", 40)
    torch_frame = Frame("embedding", "/venv/lib/python3.11/site-packages/torch/nn/functional.py", 2615)
    assert is_plumbing(json_frame) and is_plumbing(genexpr) and not is_plumbing(app) and not is_plumbing(torch_frame)
    assert code_frame([app, json_frame]) == app and code_frame([app, genexpr]) == app
    # third-party code is code (for a server we did not write, its package is what a change edits)
    assert code_frame([app, torch_frame]) == torch_frame
    assert code_frame([json_frame]) == json_frame


def test_a_lock_held_across_a_section_names_its_holder(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    snaps = []
    for i in range(20):
        waiting = i % 4 != 3  # the loop parks on the lock in three snapshots of four
        loop = loop_under(eng, frame("Engine.add_request", eng, WAKE_LINE)) if waiting else \
            loop_under(eng, frame("EpollSelector.select", f"{LIB}/selectors.py", 468))
        engine = thread_under("Engine._loop", eng, STEP_CALL_LINE, frame("gemm", str(tmp_path / "kernels.py"), 3),
                              frame("Engine._forward", eng, HELD_LINE), frame("Engine.step", eng, 15))
        snaps.append([thread("MainThread", 1, loop), thread("engine-loop", 2, engine, active=True)])
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", snaps)))
    site = report.thread_states.thread("MainThread").blocked_sites()[0]  # type: ignore[union-attr]
    assert site.holder is not None and site.holder["function"] == "Engine._forward"
    assert (site.holder["lock"], site.holder["with_line"], site.holder["share"]) == ("self._lock", 7, 1.0)
    f = next(f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED)
    # The cause is the holder: the location points at the section that holds the lock.
    assert f.location == Location(file=eng, line=HELD_LINE, function="Engine._forward", thread="engine-loop",
                                  component="server")
    assert f.evidence["function"] == "Engine.add_request" and f.evidence["holder_thread"] == "engine-loop"
    assert "held by engine-loop in Engine._forward" in f.message and "self._lock" in (f.next_question or "")


def test_a_reentrant_lock_is_held_by_its_outermost_block(tmp_path: Path) -> None:
    from infra_agent.trace.lock_holders import LockBlocks

    src = tmp_path / "reentrant.py"
    src.write_text("def run(self):\n    with self._lock:\n        self.step()\n\n"
                   "def step(self):\n    with self._lock:\n        work()\n    with self._other:\n        work()\n")
    f = str(src)
    held = LockBlocks().held([Frame("run", f, 3), Frame("step", f, 7), Frame("work", "/srv/x.py", 1)])
    assert held is not None and (held.frame.name, held.lock, held.with_line) == ("run", "self._lock", 2)
    # Another lock inside: the innermost block names the lock, and no outer block holds that one.
    held = LockBlocks().held([Frame("run", f, 3), Frame("step", f, 9)])
    assert held is not None and (held.frame.name, held.lock) == ("step", "self._other")


def test_a_condition_wait_holds_no_lock(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    waiter = loop_under(eng, frame("Engine.add_request", eng, WAKE_LINE))
    # The other thread rests in a Condition.wait made inside its own `with` block: released for the wait.
    resting = thread_under("Engine._forward", eng, HELD_LINE, frame("Condition.wait", f"{LIB}/threading.py", 327))
    snaps = [[thread("MainThread", 1, waiter), thread("engine-loop", 2, resting)] for _ in range(10)]
    report = analyze(load_timeline([], pyspy=write_dumps(tmp_path / "d.jsonl", snaps)))
    site = report.thread_states.thread("MainThread").blocked_sites()[0]  # type: ignore[union-attr]
    assert site.holder is None
    f = next(f for f in timeline_feedback(report).findings if f.kind == FindingKind.THREAD_BLOCKED)
    assert f.location is not None and (f.location.function, f.location.line) == ("Engine.add_request", WAKE_LINE)


def _step_spans(n: int, sample_us: Any) -> list[tuple[str, str, int, float, float, dict[str, Any] | None]]:
    """``n`` engine steps of 2 ms model time and a ``sample`` phase of ``sample_us(i)``, batch 4."""
    spans = []
    t = 0.0
    for i in range(n):
        s = float(sample_us(i))
        spans += [("engine.step", "engine", MAIN, t, t + 2000 + s + 500, {"batch": 4}),
                  ("decode", "engine", MAIN, t, t + 2000, {"batch": 4}),
                  ("sample", "engine", MAIN, t + 2000, t + 2000 + s, {"batch": 4})]
        t += 2000 + s + 500
    return spans


def _engine_stack(eng: str, *inner: dict[str, Any]) -> list[dict[str, Any]]:
    return thread_under("Engine._loop", eng, STEP_CALL_LINE, *inner, frame("Engine.step", eng, 15))


def test_a_growing_phase_names_the_function_that_grows_inside_it(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    spans = _step_spans(60, lambda i: 100 + 40 * i)
    end_us = spans[-1][4]
    n = 48
    snaps = []
    for i in range(n):
        late = i / n  # the growing function takes a growing share of the thread's time
        if i % 10 < 10 * late * 0.8:
            inner = [frame("extend_text", str(tmp_path / "deltas.py"), 26), frame("Engine._sample", eng, 16)]
        elif i % 2:
            inner = [frame("sample_tokens", eng, 16), frame("Engine._sample", eng, 16)]
        else:
            inner = [frame("kernel", eng, 8), frame("Engine._forward", eng, 8)]
        snaps.append([thread("MainThread", MAIN, _engine_stack(eng, *inner), gil=True, active=True)])
    tl = load_timeline([write(tmp_path / "t.json", ours(spans))],
                       pyspy=write_dumps(tmp_path / "d.jsonl", snaps, every_us=int(end_us / n)))
    report = analyze(tl)
    trend = next(t for t in report.trends if t.name == "sample")
    assert trend.rising and trend.share_last > 1.5 * trend.share_first
    assert trend.site is not None and trend.site.function == "extend_text" and trend.site.before is not None
    f = next(f for f in timeline_feedback(report).findings if f.kind == FindingKind.SPAN_TREND and f.location
             and f.location.span == "sample")
    assert f.location is not None and f.location.function == "extend_text" and f.location.line == 26
    assert "the growth is in extend_text" in f.message


def test_a_whole_machine_slowing_down_is_no_span_trend(tmp_path: Path) -> None:
    # Every phase twice as long by the end (another process took the cores): the sample phase's
    # share of its step does not move, so no span of the step rises against it.
    spans = []
    t = 0.0
    for i in range(60):
        k = 1 + i / 59
        spans += [("engine.step", "engine", MAIN, t, t + 2500 * k, {"batch": 4}),
                  ("decode", "engine", MAIN, t, t + 2000 * k, {"batch": 4}),
                  ("sample", "engine", MAIN, t + 2000 * k, t + 2400 * k, {"batch": 4})]
        t += 2500 * k
    report = analyze(load_timeline([write(tmp_path / "t.json", ours(spans))]))
    sample = next(t for t in report.trends if t.name == "sample")
    assert sample.ratio > 1.5 and sample.share_ratio == pytest.approx(1.0) and not sample.rising


def test_a_batch_that_fills_up_is_no_span_trend(tmp_path: Path) -> None:
    # One row, then eight: the sample phase takes longer by its size of work, not by time.
    spans = []
    t = 0.0
    for i in range(60):
        rows = 1 if i < 10 else 8
        spans += [("engine.step", "engine", MAIN, t, t + 1000 + 100 * rows, {"batch": rows}),
                  ("decode", "engine", MAIN, t, t + 1000, {"batch": rows}),
                  ("sample", "engine", MAIN, t + 1000, t + 1000 + 100 * rows, {"batch": rows})]
        t += 1000 + 100 * rows
    report = analyze(load_timeline([write(tmp_path / "t.json", ours(spans))]))
    sample = next(t for t in report.trends if t.name == "sample")
    assert sample.ratio == pytest.approx(8.0) and sample.size == "batch"
    assert sample.size_ratio == pytest.approx(1.0) and not sample.rising


def test_the_step_untraced_part_names_the_callee_no_span_covers(tmp_path: Path) -> None:
    eng = _engine(tmp_path)
    # 2 ms model, 0.1 ms sample, 1.5 ms in no child span: the untraced part is the largest.
    spans = _step_spans(40, lambda i: 100)
    spans = [(n, c, th, a, b + (1500 if n == "engine.step" else 0), args) for n, c, th, a, b, args in spans]
    n = 40
    snaps = []
    for i in range(n):
        inner = [frame("Engine._journal", eng, 17)] if i % 10 < 4 else \
            [frame("kernel", eng, 8), frame("Engine._forward", eng, 8)]
        snaps.append([thread("MainThread", MAIN, _engine_stack(eng, *inner), active=True)])
    tl = load_timeline([write(tmp_path / "t.json", ours(spans))],
                       pyspy=write_dumps(tmp_path / "d.jsonl", snaps, every_us=int(spans[-1][4] / n)))
    f = next(f for f in timeline_feedback(analyze(tl)).findings if f.kind == FindingKind.STEP_OVERHEAD)
    assert f.location is not None and (f.location.span, f.location.function) == ("untraced", "Engine._journal")
    assert "largest: untraced" in f.message and "the step's untraced part is Engine._journal" in f.message


def test_a_collection_records_the_code_that_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    rec._watch_gc()

    def churn() -> None:
        gc.collect()  # the callback's caller is this function, whatever triggered the collection

    churn()
    spans = [e for e in rec._TRACER.snapshot()["traceEvents"] if e["ph"] == "X" and e["name"] == "gc"]  # type: ignore[union-attr]
    assert spans and spans[-1]["args"]["function"].endswith("churn")
    assert spans[-1]["args"]["where"].startswith(__file__ + ":")


def test_the_gc_finding_names_the_code_whose_allocations_began_the_collections(tmp_path: Path) -> None:
    spans = []
    for i in range(20):  # 20 steps of 5 ms; a collection of 3 ms in each, begun by allocations in _sample
        t = i * 8000.0
        spans += [("engine.step", "engine", MAIN, t, t + 8000, None), ("decode", "engine", MAIN, t, t + 5000, None),
                  ("gc", "gc", MAIN, t + 5000, t + 8000,
                   {"generation": 0, "collected": 0, "function": "Engine._sample", "where": "/srv/engine.py:304"})]
    report = analyze(load_timeline([write(tmp_path / "t.json", ours(spans))]))
    assert report.gc is not None and report.gc.sites[0]["count"] == 20 and report.gc.sites[0]["share"] == 1.0
    f = next(f for f in timeline_feedback(report).findings if f.kind == FindingKind.GC_PAUSE)
    assert f.location is not None and (f.location.file, f.location.line, f.location.function) == \
        ("/srv/engine.py", 304, "Engine._sample")
    assert "allocations in Engine._sample (/srv/engine.py:304) began 20 of them" in f.message
    assert "What does Engine._sample" in (f.next_question or "") and "gc.freeze()" in (f.next_question or "")
