"""The planner picks the cheapest covering probe; the rules proposer follows the findings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra_agent.agent.planner import Planner, ProbeCost
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.rules import RulesProposer, load_playbook
from infra_agent.errors import ConfigError, InfraAgentError
from infra_agent.feedback import Feedback, Finding, Location, Tier
from infra_agent.records import Change, Experiment, Hypothesis, RunRecord, Step
from infra_agent.workspace import load_workspace

from .loop_workspace import make_workspace

KERNEL_CHECK = {"name": "lm-head-tp", "probe": "kernel", "components": ["model.lm_head"],
                "config": {"spec": "spec.py", "precisions": "{lm_head_precision}"}}
UNIT_CHECK = {"name": "unit", "probe": "command", "components": ["engine"], "config": {"command": "true"}}
PRECISION = {"lm_head_precision": {"type": "choice", "choices": ["fp32", "tf32", "3xtf32"], "default": "tf32",
                                   "components": ["model.lm_head"]}}


@pytest.fixture
def ws(tmp_path: Path):  # type: ignore[no-untyped-def]
    root = make_workspace(tmp_path / "ws", extra_knobs=PRECISION, checks=[KERNEL_CHECK, UNIT_CHECK])
    (root / "spec.py").write_text("")
    return load_workspace(root)


def _step(metric: str, **loc: str) -> Step:
    return Step(hypothesis=Hypothesis(statement="s", metric=metric, direction="lower", locality=Location(**loc)))


def test_a_kernel_question_goes_to_the_kernel_lab_not_a_deployment(ws) -> None:  # type: ignore[no-untyped-def]
    plan = Planner(ws).plan(_step("failed_checks", kernel="lm_head", precision="3xtf32"), ["model.lm_head"])
    assert (plan.probe.name, plan.probe.tier, plan.mode, plan.check) == ("kernel", Tier.check, "pair", "lm-head-tp")
    assert "cheapest probe whose scope covers" in plan.probe.reason
    # A timing claim about the same kernel is a microbenchmark.
    plan = Planner(ws).plan(_step("median_s", kernel="lm_head"), [])
    assert (plan.probe.tier, plan.probe.config["mode"]) == (Tier.micro, "bench")


def test_an_e2e_claim_gets_the_serving_ab_after_related_cheap_gates(ws) -> None:  # type: ignore[no-untyped-def]
    plan = Planner(ws, {("command", "check"): ProbeCost(4, 2.5), ("serving", "e2e"): ProbeCost(3, 31.0)}).plan(
        _step("output_throughput", component="engine.scheduler"), ["engine.scheduler"])
    assert (plan.probe.name, plan.mode, plan.scenarios) == ("serving", "ab", ["chat"])
    assert plan.pre_checks == ["unit"]  # engine covers engine.scheduler; the LM-head check is unrelated
    assert "~31.0 s measured over 3 run(s)" in plan.probe.reason
    assert "output_throughput" in plan.result_metrics
    # A code change runs every check first.
    step = _step("output_throughput", component="engine.scheduler")
    step.change = Change(diff="--- a/x\n+++ b/x\n")
    assert sorted(Planner(ws).plan(step, []).pre_checks) == ["lm-head-tp", "unit"]


def test_a_question_no_probe_covers_is_an_error_that_says_so(ws) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InfraAgentError, match="no registered probe covers"):
        Planner(ws).plan(_step("failed_checks", thread="transfer"), [])


def _state(ws, findings: list[Finding], knobs: dict | None = None, history: list[Experiment] | None = None) -> LoopState:  # type: ignore[no-untyped-def, type-arg]
    run = RunRecord(id="r", workspace=str(ws.root), proposer="rules", started_at=time.time())
    best = Experiment(id="e0", run_id="r", seq=0, role="baseline", hypothesis=Hypothesis(statement="b", metric="-", direction="higher"),
                      knobs=knobs or dict(ws.resolve_knobs()))
    fb = Feedback(probe="serving", tier=Tier.e2e, findings=findings)
    return LoopState(workspace=ws, run=run, best=best, history=[best, *(history or [])], feedback=[fb])


QUEUE = Finding(kind="queue_dominates_ttft", severity="warning", message="q", location=Location(component="engine.scheduler"),
                evidence={"queue_ms": 812.4, "share": 0.93, "scenario": "chat"})
MISMATCH = Finding(kind="mismatch", severity="error", message="m",
                   location=Location(kernel="kda_o_proj_to_lm_head", variant="tp2", precision="tf32"))


def test_rules_follow_the_findings_most_severe_first(ws) -> None:  # type: ignore[no-untyped-def]
    prop = RulesProposer()
    step = prop.propose(_state(ws, [QUEUE, MISMATCH]))
    assert step is not None and step.change.knobs == {"lm_head_precision": "3xtf32"}
    assert step.hypothesis.metric == "failed_checks" and step.hypothesis.locality.kernel == "kda_o_proj_to_lm_head"
    assert step.hypothesis.locality.precision == "3xtf32"
    step = prop.propose(_state(ws, [QUEUE]))
    assert step is not None and step.change.knobs == {"max_running": 16}  # 4 x 4
    assert "812 ms" in step.hypothesis.statement and "93% of TTFT" in step.hypothesis.statement
    assert step.hypothesis.scenario == "chat" and step.hypothesis.locality.component == "engine.scheduler"


def test_rules_clamp_to_the_domain_and_never_repeat_a_change(ws) -> None:  # type: ignore[no-untyped-def]
    prop = RulesProposer()
    step = prop.propose(_state(ws, [QUEUE], knobs={**ws.resolve_knobs(), "max_running": 40}))
    assert step is not None and step.change.knobs == {"max_running": 64}  # 160 clamped to max
    tried = Experiment(id="e1", run_id="r", seq=1, parent="e0", hypothesis=step.hypothesis, change=step.change)
    assert prop.propose(_state(ws, [QUEUE], knobs={**ws.resolve_knobs(), "max_running": 40}, history=[tried])) is None
    assert prop.stopped_reason and "no rule" in prop.stopped_reason
    # Already at the domain's edge: nothing to propose.
    assert RulesProposer().propose(_state(ws, [QUEUE], knobs={**ws.resolve_knobs(), "max_running": 64})) is None


def test_a_bad_playbook_names_file_field_and_value(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("rules:\n  - name: x\n    when: {kind: queue_is_long}\n    change: {knob: [a], set: 1}\n"
                   "    hypothesis: {statement: s, metric: m, direction: higher}\n")
    with pytest.raises(ConfigError, match=r"p.yaml:3:\d+: rules.0.when.*queue_dominates_ttft.*queue_is_long"):
        load_playbook(bad)
    bad.write_text("rules: [")
    with pytest.raises(ConfigError, match="valid YAML"):
        load_playbook(bad)


CASE_B_KNOBS = {
    "ep_release_gil": {"type": "bool", "default": False, "components": ["comm", "model.moe"]},
    "kv_page_tokens": {"type": "int", "min": 1, "max": 4096, "default": 2, "components": ["kv_transfer"]},
}


def _gil(component: str, holder: str, span: str) -> Finding:
    return Finding(kind="gil_contention", severity="warning", message="g",
                   location=Location(component=component, thread=holder, span=span, file="x.py:1"),
                   evidence={"waiting_thread": "engine-loop", "waiting_share": "95%"})


def test_case_b_first_releases_the_gil_in_the_ep_section_then_enlarges_the_transfer_pages(tmp_path: Path) -> None:
    ws = load_workspace(make_workspace(tmp_path / "ws", extra_knobs=CASE_B_KNOBS))
    prop = RulesProposer()
    ep, pages = _gil("comm", "engine-loop", "ep.dispatch|ep.combine"), _gil("kv_transfer", "kv-transfer", "kv.transfer")
    # The held baseline: the transfer thread waits on the EP section (findings of equal
    # severity are taken in the probe's order: an idle GIL holder first, then the larger wait).
    step = prop.propose(_state(ws, [ep, pages]))
    assert step is not None and step.change.knobs == {"ep_release_gil": True}
    # With the GIL released, what is left is the engine waiting on the transfer thread's own Python.
    released = {**ws.resolve_knobs(), "ep_release_gil": True}
    step = prop.propose(_state(ws, [pages], knobs=released))
    assert step is not None and step.change.knobs == {"kv_page_tokens": 8}
    assert "engine-loop waited for the GIL held by kv-transfer" in step.hypothesis.statement
    assert step.hypothesis.metric == "total_token_throughput" and step.hypothesis.locality.span == "kv.transfer"
