"""Pauses of Python's garbage collector: recorded as spans, summarised, turned into a finding with a knob."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

import infra_agent.tracing.recorder as rec
from infra_agent.agent.proposers.rules import RulesProposer
from infra_agent.trace.analyze import analyze
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import load_timeline
from infra_agent.tracing.recorder import Tracer
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace import Workspace, load_workspace

from .synth import MAIN, ours, write

GC_FREEZE = "gc_freeze: {type: bool, default: false, components: [runtime.gc]}"
TORCH_THREADS = "torch_threads: {type: int, min: 0, max: 64, default: 0, components: [runtime]}"


def _knob_workspace(tmp_path: Path, *knobs: str) -> Workspace:
    """A URL workspace holding only ``knobs`` (their YAML lines)."""
    (tmp_path / "infra-agent.yaml").write_text(
        "name: gc\ntarget: {kind: endpoint, url: 'http://127.0.0.1:9'}\nknobs:\n"
        + "".join(f"  {k}\n" for k in knobs)
        + "scenarios: {chat: {dataset: {kind: random, input_len: 8, output_len: 8}, num_requests: 4}}\n")
    return load_workspace(tmp_path)


def test_a_collection_is_a_gc_span_on_the_thread_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    rec._watch_gc()
    t = threading.Thread(target=gc.collect, name="collector-thread")
    t.start()
    t.join()
    gc.collect(0)
    snap = rec._TRACER.snapshot()  # type: ignore[union-attr]
    names = {e["tid"]: e["args"]["name"] for e in snap["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in snap["traceEvents"] if e["ph"] == "X" and e["name"] == "gc"]
    full = [e for e in spans if e["args"]["generation"] == 2]
    assert full and names[full[0]["tid"]] == "collector-thread" and full[0]["cat"] == "gc" and full[0]["dur"] > 0
    assert any(e["args"]["generation"] == 0 and names[e["tid"]] == "MainThread" for e in spans)


def test_no_gc_span_while_tracing_is_off_or_its_level_leaves_gc_out(monkeypatch: pytest.MonkeyPatch) -> None:
    off = Tracer(enabled=False)
    monkeypatch.setattr(rec, "_TRACER", off)
    rec._watch_gc()
    gc.collect()
    skipping = Tracer(enabled=True)
    skipping.skip_cats = frozenset({"gc"})
    monkeypatch.setattr(rec, "_TRACER", skipping)
    gc.collect()
    for tracer in (off, skipping):
        assert not [e for e in tracer.snapshot()["traceEvents"] if e.get("name") == "gc"]


def _steps_with_a_full_collection() -> list:
    spans = []
    for i in range(20):  # 20 steps of 5 ms; a 90 ms full collection inside step 10
        t = i * 5000.0 + (90_000.0 if i > 10 else 0.0)
        end = t + 5000 + (90_000 if i == 10 else 0)
        spans.append(("engine.step", "engine", MAIN, t, end, None))
        spans.append(("decode", "engine", MAIN, t, t + 4000, None))
        if i == 10:
            spans.append(("gc", "gc", MAIN, t + 4000, t + 94_000, {"generation": 2, "collected": 0}))
        elif i % 4 == 0:
            spans.append(("gc", "gc", MAIN, t + 4000, t + 4050, {"generation": 0, "collected": 12}))
    return spans


def test_a_long_full_collection_is_a_finding_at_runtime_gc(tmp_path: Path) -> None:
    report = analyze(load_timeline([write(tmp_path / "t.json", ours(_steps_with_a_full_collection()))]))
    assert report.gc is not None
    assert report.gc.count == 6 and report.gc.longest_us == 90_000 and report.gc.longest_generation == 2
    assert report.gc.by_generation[2]["count"] == 1 and report.gc.by_generation[0]["count"] == 5
    assert report.gc.total_us == pytest.approx(90_000 + 5 * 50)
    fb = timeline_feedback(report, knob_hints={"gc": "gc_freeze"})
    f = next(f for f in fb.findings if f.kind == FindingKind.GC_PAUSE)
    assert f.location is not None and (f.location.component, f.location.span, f.location.knob) == ("runtime.gc", "gc", "gc_freeze")
    assert "the longest, generation 2, took 90.0 ms" in f.message and "gc.freeze()" in (f.next_question or "")
    assert report.to_dict()["gc"]["by_generation"]["2"]["longest_us"] == 90_000


def test_young_collections_alone_are_no_finding(tmp_path: Path) -> None:
    spans = [s for s in _steps_with_a_full_collection() if not (s[0] == "gc" and s[5]["generation"] == 2)]
    report = analyze(load_timeline([write(tmp_path / "t.json", ours(spans))]))
    assert report.gc is not None and report.gc.count == 5
    assert not [f for f in timeline_feedback(report).findings if f.kind == FindingKind.GC_PAUSE]


def test_the_playbook_freezes_the_heap_on_a_gc_finding(tmp_path: Path) -> None:
    from infra_agent.agent.proposers.base import LoopState
    from infra_agent.records import Experiment, Hypothesis, RunRecord

    ws = _knob_workspace(tmp_path, GC_FREEZE, TORCH_THREADS)
    report = analyze(load_timeline([write(tmp_path / "t.json", ours(_steps_with_a_full_collection()))]))
    fb = timeline_feedback(report)
    base = Experiment(id="e0", run_id="r", seq=0, role="baseline", proposer="-", status="done",
                      hypothesis=Hypothesis(statement="baseline", metric="-", direction="higher"), knobs={"gc_freeze": False})
    state = LoopState(workspace=ws, run=RunRecord(id="r", workspace=str(tmp_path), proposer="rules", started_at=0.0),
                      best=base, history=[base], feedback=[fb])
    step = RulesProposer().propose(state)
    assert step is not None and step.change.knobs == {"gc_freeze": True}
    assert step.hypothesis.metric == "gc_pause_ms" and step.hypothesis.direction == "lower"


def test_the_timeline_probe_names_the_knob_declared_on_runtime_gc(tmp_path: Path) -> None:
    from infra_agent.feedback import Finding, Location
    from infra_agent.probes.timeline_locate import locate

    ws = _knob_workspace(tmp_path, GC_FREEZE, TORCH_THREADS)
    f = Finding(kind=FindingKind.GC_PAUSE, message="m", next_question="q?",
                location=Location(component="runtime.gc", span="gc"))
    locate(f, {"gc": "runtime.gc"}, {"gc": "gc"}, ws, {})
    # torch_threads acts on runtime too, but only gc_freeze is declared on runtime.gc itself.
    assert f.location is not None and f.location.knob == "gc_freeze" and "Try knob gc_freeze." in (f.next_question or "")


def test_the_planner_answers_the_gc_hypothesis_with_the_timeline_probe(tmp_path: Path) -> None:
    from infra_agent.agent.planner import Planner
    from infra_agent.agent.proposers.rules import load_playbook
    from infra_agent.feedback import Location
    from infra_agent.records import Change, Hypothesis, Step

    ws = _knob_workspace(tmp_path, GC_FREEZE)
    rule = next(r for r in load_playbook().rules if r.name == "freeze-gc-heap")
    step = Step(hypothesis=Hypothesis(statement="s", metric=rule.hypothesis.metric, direction=rule.hypothesis.direction,
                                      min_effect=rule.hypothesis.min_effect,
                                      locality=Location(**rule.hypothesis.locality)),
                change=Change(knobs={"gc_freeze": True}))
    plan = Planner(ws, {}).plan(step, ["runtime.gc"])
    assert (plan.probe.name, plan.mode) == ("timeline", "ab")


def test_no_knob_is_named_when_none_is_declared_on_runtime_gc(tmp_path: Path) -> None:
    from infra_agent.feedback import Finding, Location
    from infra_agent.probes.timeline_locate import locate

    ws = _knob_workspace(tmp_path, TORCH_THREADS)
    f = Finding(kind=FindingKind.GC_PAUSE, message="m", location=Location(component="runtime.gc", span="gc"))
    locate(f, {"gc": "runtime.gc"}, {"gc": "gc"}, ws, {})
    assert f.location is not None and f.location.knob is None
