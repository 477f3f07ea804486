"""Interval analysis on synthetic traces whose overlaps and GIL holders are known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.trace.analyze import analyze
from infra_agent.trace.critical import critical_path
from infra_agent.trace.diff import diff, self_times
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.intervals import intersect, merge, subtract, total
from infra_agent.trace.load import load_timeline
from infra_agent.trace.merge import merged_events
from infra_agent.trace.overlap import overlap_matrix
from infra_agent.vocabulary import FindingKind

from .synth import (
    KV,
    MAIN,
    ORIGIN_NS,
    case_b_pyspy,
    case_b_spans,
    ours,
    set_mtime_ns,
    write,
)


def test_interval_algebra() -> None:
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert intersect([(0, 4), (5, 8)], [(3, 6)]) == [(3, 4), (5, 6)]
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert total(merge([(0, 1), (0.5, 2)])) == 2


def test_overlap_matrix_exact(tmp_path: Path) -> None:
    tl = load_timeline([write(tmp_path / "t.json", case_b_spans())])
    m = overlap_matrix(tl.spans)
    assert m.groups == {"engine@MainThread": 8000, "ep@MainThread": 4000, "kv_transfer@kv-transfer": 8000}
    p = m.pair("kv_transfer@kv-transfer", "ep@MainThread")
    assert p is not None and p.both_us == 4000 and p.share_of_a == 0.5 and p.share_of_b == 1.0
    # same-thread nesting is not reported
    assert m.pair("engine@MainThread", "ep@MainThread") is None


def test_single_thread_trace_says_so(tmp_path: Path) -> None:
    tl = load_timeline([write(tmp_path / "t.json", ours([("a", "x", MAIN, 0, 10, None), ("b", "y", MAIN, 5, 20, None)]))])
    report = analyze(tl)
    assert "every span is on one thread (MainThread)" in report.overlap.note
    kinds = {f.kind for f in timeline_feedback(report).findings}
    assert FindingKind.OVERLAP_UNMEASURABLE in kinds


def test_gil_attribution_exact(tmp_path: Path) -> None:
    spy = write(tmp_path / "spy.json", case_b_pyspy())
    tl = load_timeline([write(tmp_path / "t.json", case_b_spans())], pyspy=spy, pyspy_start_unix_ns=ORIGIN_NS)
    assert tl.sampled_window == (0.0, 8000.0)
    assert {s.thread for s in tl.samples} == {"MainThread", "kv-transfer"}  # matched by pthread ident
    report = analyze(tl, expect_overlap=[("transfer", "ep.dispatch|ep.combine")])
    kv = next(w for w in report.waits if w.thread == "kv-transfer")
    assert (kv.span_us, kv.waiting_us, kv.intervals) == (8000, 4000, 2)
    assert kv.holder_threads == {"MainThread": 1.0}
    assert [(h.where, h.share) for h in kv.holders] == [("moe.py:42", 0.5), ("moe.py:77", 0.5)]
    main = next(w for w in report.waits if w.thread == "MainThread" and w.group == "ep")
    assert main.waiting_us == 0
    kv_time = next(t for t in report.threads if t.thread == "kv-transfer")
    assert (kv_time.busy_us, kv_time.waiting_us) == (8000, 4000)
    assert report.holder_spans["kv_transfer@kv-transfer"] == {"thread": "MainThread", "span": "ep.dispatch|ep.combine",
                                                              "share_of_wait": 1.0, "by": "stack"}
    exp = report.expected[0]
    assert (exp.a_us, exp.b_us, exp.both_us) == (8000, 4000, 4000)
    assert exp.holders_during_b[0]["thread"] == "MainThread"
    fb = timeline_feedback(report, knob_hints={"moe.py": "ep_release_gil"})
    gil = next(f for f in fb.findings if f.kind == FindingKind.GIL_CONTENTION and f.evidence["waiting_thread"] == "kv-transfer")
    assert gil.location is not None and gil.location.file == "moe.py" and gil.location.line == 42
    assert gil.location.thread == "MainThread" and gil.location.knob == "ep_release_gil"
    assert gil.evidence["waiting_share"] == 0.5 and "ep_release_gil" in (gil.next_question or "")
    json.loads(fb.to_json())


def test_case_b_no_overlap_finding(tmp_path: Path) -> None:
    # the bad scenario: transfers only run between the EP intervals
    doc = ours([("ep.dispatch", "ep", MAIN, 1000, 3000, None), ("ep.combine", "ep", MAIN, 5000, 7000, None),
                ("transfer", "kv_transfer", KV, 3000, 5000, None), ("transfer", "kv_transfer", KV, 7000, 8000, None)])
    spy = write(tmp_path / "spy.json", case_b_pyspy())
    tl = load_timeline([write(tmp_path / "t.json", doc)], pyspy=spy, pyspy_start_unix_ns=ORIGIN_NS)
    report = analyze(tl, expect_overlap=[("transfer", "ep.dispatch|ep.combine")])
    assert report.expected[0].both_us == 0
    f = next(f for f in timeline_feedback(report).findings if f.kind == FindingKind.NO_OVERLAP)
    assert f.message.startswith("transfer (thread kv-transfer) overlapped 0% of ep.dispatch|ep.combine (thread MainThread)")
    assert "GIL holder was MainThread at moe.py:42 in 50%" in f.message
    assert f.location is not None and (f.location.file, f.location.line) == ("moe.py", 42)


def test_pyspy_clock_from_mtime_and_offset(tmp_path: Path) -> None:
    spy = write(tmp_path / "spy.json", case_b_pyspy())
    # py-spy wrote the file at its ts 8000 µs; with mtime = origin + 8 ms + 1 ms the zero is origin + 1 ms
    set_mtime_ns(spy, ORIGIN_NS + 9_000_000)
    tl = load_timeline([write(tmp_path / "t.json", case_b_spans())], pyspy=spy)
    assert tl.sampled_window == pytest.approx((1000.0, 9000.0), abs=1.0)  # mtime granularity
    tl = load_timeline([write(tmp_path / "t.json", case_b_spans())], pyspy=spy, pyspy_offset_us=-1000)
    assert tl.sampled_window == pytest.approx((0.0, 8000.0), abs=1.0)


def test_two_processes_on_one_clock(tmp_path: Path) -> None:
    # a decode worker whose tracer started 5 ms after the prefill worker's
    a = write(tmp_path / "a.json", ours([("prefill", "engine", MAIN, 0, 1000, None)]))
    b_doc = ours([("decode", "engine", MAIN, 0, 1000, None)], origin_ns=ORIGIN_NS + 5_000_000)
    for ev in b_doc["traceEvents"]:
        ev["pid"] = 8
    tl = load_timeline([a, write(tmp_path / "b.json", b_doc)])
    dec = next(s for s in tl.spans if s.name == "decode")
    assert (dec.start_us, dec.thread) == (5000.0, "MainThread[8]")


def test_critical_path_by_rid(tmp_path: Path) -> None:
    doc = ours([("engine.step", "engine", MAIN, 100, 300, None), ("tokenize", "server", KV, 0, 100, {"rid": "r1"}),
                ("stream", "server", KV, 400, 450, {"rid": "r1"})],
               instants=[("http.submit", KV, 0, {"request_id": "r1"}), ("http.done", KV, 500, {"request_id": "r1"})])
    tl = load_timeline([write(tmp_path / "t.json", doc)])
    path = critical_path(tl, "r1")
    assert path is not None
    assert [(s.name, s.kind, s.start_us, s.end_us) for s in path.segments] == [
        ("tokenize", "request", 0, 100), ("engine.step", "shared", 100, 300), ("untraced", "untraced", 300, 400),
        ("stream", "request", 400, 450), ("untraced", "untraced", 450, 500)]
    assert path.shares()["engine.step"] == pytest.approx(0.4)


def test_self_times_and_diff(tmp_path: Path) -> None:
    a = load_timeline([write(tmp_path / "a.json", ours([("step", "e", MAIN, 0, 100, None), ("fwd", "m", MAIN, 10, 60, None)]))])
    b = load_timeline([write(tmp_path / "b.json", ours([("step", "e", MAIN, 0, 150, None), ("fwd", "m", MAIN, 10, 60, None),
                                                            ("sample", "e", MAIN, 60, 120, None)]))])
    assert sorted((s.name, own) for s, own in self_times(a.spans)) == [("fwd", 50), ("step", 50)]
    d = diff(a, b)
    assert d.e2e_delta_us == 50
    top = d.spans[0]
    assert (top.key, top.delta_us, d.share(top)) == ("sample", 60, 1.2)
    assert [(r.key, r.delta_us) for r in d.spans[1:]] == [("step", -10), ("fwd", 0)]


def test_merged_output_has_gil_track(tmp_path: Path) -> None:
    spy = write(tmp_path / "spy.json", case_b_pyspy())
    tl = load_timeline([write(tmp_path / "t.json", case_b_spans())], pyspy=spy, pyspy_start_unix_ns=ORIGIN_NS)
    doc = merged_events(tl)
    gil = [e for e in doc["traceEvents"] if e.get("cat") == "gil"]
    assert [(e["ts"], e["dur"], e["args"]["where"]) for e in gil] == [
        (0.0, 1000.0, "kv.py:10"), (1000.0, 2000.0, "moe.py:42"), (3000.0, 2000.0, "kv.py:11"),
        (5000.0, 2000.0, "moe.py:77"), (7000.0, 1000.0, "kv.py:12")]
    # the merged file loads back on the same clock
    back = load_timeline([write(tmp_path / "m.json", doc)])
    assert sorted(s.start_us for s in back.spans if s.name == "ep.dispatch") == [1000.0]


def test_back_to_back_engine_phases_are_siblings_after_the_us_round_trip(tmp_path: Path) -> None:
    """The engine's step phases end exactly where the next begins (one clock read per
    boundary).  Written as µs floats and read back, a phase must still end before the next
    starts: self times give each phase its own duration and ``engine.step`` only the gap
    after the last phase, and every step is a top-level span of the critical path."""
    import random

    from infra_agent.tracing.recorder import Tracer
    from refstack.engine import step_trace

    tracer = Tracer(enabled=True, level="step")
    layout = step_trace.layout()
    sink = tracer.int_sink("engine")
    assert sink is not None
    rng = random.Random(7)
    t = tracer.origin_perf_ns + 123_456_789
    for _ in range(300):  # ns boundaries at random: ~1 in 8 rounds up in µs without the fix
        t_step = t
        t_sched = t_step + rng.randrange(1_000, 50_000)
        t_decode = t_sched + rng.randrange(100_000, 400_000)
        t_sample = t_decode + rng.randrange(1_000, 50_000)
        t_end = t_sample + 5_000
        sink(layout.pack(layout.id, t_step, t_sched, t_decode, -1, t_sample, t_end, 0, 8,
                         8, 8, 400, 200, *step_trace.EMPTY_SHAPE))
        t = t_end + rng.randrange(1_000, 9_000)
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(tracer.snapshot()))
    spans = load_timeline([path]).spans
    own = {}
    for s, us in self_times(spans):
        own.setdefault(s.name, []).append((us, s.end_us - s.start_us))
    assert len(own["engine.step"]) == 300
    assert all(us == pytest.approx(5.0, abs=1e-2) for us, _ in own["engine.step"])  # the 5 µs after sample
    for name in ("schedule", "decode", "sample"):
        assert all(us == pytest.approx(dur, abs=1e-2) for us, dur in own[name]), name
