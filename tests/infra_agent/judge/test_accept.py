"""The accept rule: a change that makes requests fail is never accepted on its latencies."""

from __future__ import annotations

from pathlib import Path

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.planner import Plan
from infra_agent.feedback import Feedback, Finding, Measurement, Tier
from infra_agent.judge.accept import judge
from infra_agent.records import Experiment, Hypothesis, ProbeCall
from infra_agent.workspace import load_workspace

from ..agent.loop_workspace import make_workspace


def _run(ttft_p90: float, failed: int = 0) -> Feedback:
    fb = Feedback(probe="serving", tier=Tier.e2e,
                  measurements=[Measurement.from_samples("p90_ttft_ms", "ms", [ttft_p90], "lower", scenario="chat")])
    if failed:
        fb.findings.append(Finding(kind="failed_requests", severity="error", message=f"{failed} failed",
                                   evidence={"failed": failed}))
    return fb


def test_failed_requests_block_acceptance_even_when_latency_improves(tmp_path: Path) -> None:
    ws = load_workspace(make_workspace(tmp_path / "ws", criteria=[]))
    exp = Experiment(id="e1", run_id="r", seq=1, parent="e0",
                     hypothesis=Hypothesis(statement="a queue cap cuts TTFT", metric="p90_ttft_ms", direction="lower",
                                           min_effect=0.2, scenario="chat"))
    plan = Plan(probe=ProbeCall(name="serving", tier=Tier.e2e), mode="ab", scenarios=["chat"])
    base = [_run(1000), _run(1010), _run(990)]
    # 3x lower TTFT, but 5 requests per window were turned away (HTTP 503): not a fix.
    rejected = Execution(status="done", baseline={"chat": base}, candidate={"chat": [_run(330, 5), _run(340, 5), _run(335, 5)]})
    v = judge(ws, exp, rejected, plan, {})
    assert v.outcome == "supported" and not v.accepted and "15 more request(s) failed" in v.message
    fine = Execution(status="done", baseline={"chat": base}, candidate={"chat": [_run(330), _run(340), _run(335)]})
    assert judge(ws, exp, fine, plan, {}).accepted


def test_answers_of_the_wrong_length_are_named_whatever_the_numbers_decided(tmp_path: Path) -> None:
    """Correctness before speed: a side that answered fewer tokens than asked is refused for
    that, also where its latencies alone are inconclusive (a 'more pairs' reading would only
    measure the shorter answers again)."""
    ws = load_workspace(make_workspace(tmp_path / "ws", criteria=[]))
    exp = Experiment(id="e1", run_id="r", seq=1, parent="e0",
                     hypothesis=Hypothesis(statement="a faster sampler cuts TTFT", metric="p90_ttft_ms",
                                           direction="lower", min_effect=0.2, scenario="chat"))
    plan = Plan(probe=ProbeCall(name="serving", tier=Tier.e2e), mode="ab", scenarios=["chat"])

    def short(ttft: float) -> Feedback:
        fb = _run(ttft)
        fb.findings.append(Finding(kind="wrong_answer_length", severity="error", message="8 of 16 short",
                                   evidence={"short": 8, "long": 0, "checked": 16}))
        return fb

    base = [_run(1000), _run(1010), _run(990)]
    # Spread wide enough that the interval straddles the 0.8 target: inconclusive by the numbers.
    noisy = Execution(status="done", baseline={"chat": base}, candidate={"chat": [short(500), short(1100), short(700)]})
    v = judge(ws, exp, noisy, plan, {})
    assert v.outcome == "inconclusive" and not v.accepted, v
    assert "24 more answer(s)" in v.message and "not the length the request fixed" in v.message, v.message
