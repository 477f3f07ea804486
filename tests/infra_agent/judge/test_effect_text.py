"""The effect as the progress line and the tools print it: a count shows its move, not 'effect 0 [0, 0]'."""

from __future__ import annotations

from pathlib import Path

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.planner import Plan
from infra_agent.feedback import Feedback, Measurement, Tier
from infra_agent.judge.accept import judge
from infra_agent.judge.effect_text import effect_text
from infra_agent.records import Experiment, Hypothesis, ProbeCall
from infra_agent.tools.experiment import _outcome
from infra_agent.workspace import load_workspace

from ..agent.loop_workspace import make_workspace


def _judged(tmp_path: Path, hyp: Hypothesis, base: list[Feedback], cand: list[Feedback], plan: Plan) -> Experiment:
    ws = load_workspace(make_workspace(tmp_path / "ws", criteria=[]))
    exp = Experiment(id="e1", run_id="r", seq=1, parent="e0", hypothesis=hyp)
    key = plan.check if plan.mode == "pair" else hyp.scenario
    assert key is not None
    exp.verdict = judge(ws, exp, Execution(status="done", baseline={key: base}, candidate={key: cand}), plan, {})
    exp.baseline_feedback = base[0]  # what the loop keeps of the parent's side
    return exp


def test_a_count_fix_prints_its_move_not_a_zero_ratio(tmp_path: Path) -> None:
    exp = _count_fix(tmp_path)
    assert exp.verdict is not None and exp.verdict.outcome == "supported" and exp.verdict.effect == 0
    assert effect_text(exp) == "failed_checks 3 → 0 (exact count)"
    assert "effect 0 [0, 0]" not in _outcome(exp) and "failed_checks 3 → 0" in _outcome(exp)


def test_a_ratio_prints_its_interval(tmp_path: Path) -> None:
    def run(x: float) -> Feedback:
        return Feedback(probe="serving", tier=Tier.e2e, measurements=[
            Measurement.from_samples("output_throughput", "tok/s", [x], "higher", scenario="chat")])

    hyp = Hypothesis(statement="more batch", metric="output_throughput", direction="higher", min_effect=0.05,
                     scenario="chat")
    exp = _judged(tmp_path, hyp, [run(100), run(101), run(99)], [run(120), run(122), run(119)],
                  Plan(probe=ProbeCall(name="serving", tier=Tier.e2e), mode="ab", scenarios=["chat"]))
    text = effect_text(exp)
    assert exp.verdict is not None and text.startswith("effect 1.2") and "[" in text
    assert text in _outcome(exp)


def _count_fix(tmp_path: Path) -> Experiment:
    def checks(n: int) -> Feedback:
        return Feedback(probe="kernel-check", tier=Tier.check, ok=n == 0, meta={"failed_checks": n})

    hyp = Hypothesis(statement="fp32 accumulation fixes the TP checks", metric="failed_checks", direction="lower",
                     min_effect=1)
    plan = Plan(probe=ProbeCall(name="kernel-check", tier=Tier.check), mode="pair", check="tp-checks")
    exp = _judged(tmp_path, hyp, [checks(3)], [checks(0)], plan)
    exp.status, exp.feedback, exp.probe = "done", checks(0), plan.probe
    return exp


def test_a_count_fix_in_the_mcp_and_llm_result_text_and_the_commit_message(tmp_path: Path) -> None:
    # run_experiment's result (the MCP tool's text and the llm proposer's) and the accepted
    # change's commit message printed "effect=0 [0, 0] (exact count)" for 3 -> 0.
    from infra_agent.agent.conclusion import describe_gate
    from infra_agent.agent.judging import commit_message
    from infra_agent.agent.proposers.llm_prompt import experiment_result

    exp = _count_fix(tmp_path)
    assert exp.verdict is not None and exp.verdict.accepted
    result = experiment_result(exp)
    verdict_line = next(line for line in result.splitlines() if line.startswith("verdict:"))
    assert verdict_line.startswith("verdict: SUPPORTED failed_checks 3 → 0 (exact count);"), verdict_line
    hyp_gate = next(line for line in result.splitlines() if line.startswith("- hypothesis:"))
    assert "value=0 (exact count)" in hyp_gate, hyp_gate
    assert "[0, 0]" not in result
    message = commit_message(exp)
    assert "Verdict: supported, failed_checks 3 → 0 (exact count)" in message and "[0, 0]" not in message
    gate = next(g for g in exp.verdict.gates if g.kind == "hypothesis")
    assert describe_gate(gate) == "hypothesis is pass (0, exact count)"
