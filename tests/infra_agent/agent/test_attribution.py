"""Attribution: findings ranked onto the knobs through their components."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.proposers.attribution import KnobScore, closeness, rank_knobs
from infra_agent.feedback import Finding, Location
from infra_agent.records import GateResult
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "refstack-serving"


@pytest.fixture(scope="module")
def ws() -> Workspace:
    return load_workspace(EXAMPLE)


def finding(kind: str, component: str | None = None, severity: str = "warning", knob: str | None = None,
            **evidence: object) -> Finding:
    loc = Location(component=component, knob=knob) if component or knob else None
    return Finding(kind=kind, message=kind, severity=severity, location=loc, evidence=dict(evidence))  # type: ignore[arg-type]


def by_name(scores: list[KnobScore]) -> dict[str, KnobScore]:
    return {s.name: s for s in scores}


def test_closeness() -> None:
    assert closeness("engine.scheduler", "engine.scheduler") == 1.0
    assert closeness("engine", "engine.scheduler") == 0.5
    assert closeness("model.lm_head", "model") == 0.5
    assert closeness("engine.loop", "engine.scheduler") == 0.0
    assert closeness("model", "modelx") == 0.0


def test_queue_finding_ranks_the_scheduler_knobs(ws: Workspace) -> None:
    scores = rank_knobs(ws, [finding("queue_dominates_ttft", "engine.scheduler", share=0.8)], [])
    names = [s.name for s in scores]
    # max_running acts only on the scheduler; the other three spread over two components.
    assert names[:4] == ["max_running", "max_batch_tokens", "max_waiting", "prefill_chunk"]
    s = by_name(scores)
    assert s["max_running"].score == pytest.approx(2 * 0.8)
    assert s["max_batch_tokens"].score == pytest.approx(2 * 0.8 / 2)
    assert s["max_running"].kinds == ("queue_dominates_ttft",)
    assert s["max_running"].explain() == "queue_dominates_ttft at engine.scheduler"
    # Unrelated knobs score 0, in name order.
    assert [x.name for x in scores[4:]] == ["lm_head_precision", "step_delay_ms", "step_slowdown", "torch_threads"]
    assert all(x.score == 0 and not x.reasons for x in scores[4:])


def test_severity_and_share_weigh(ws: Workspace) -> None:
    low = by_name(rank_knobs(ws, [finding("q", "engine.scheduler", share=0.5)], []))["max_running"].score
    high = by_name(rank_knobs(ws, [finding("q", "engine.scheduler", share=1.0)], []))["max_running"].score
    assert high == pytest.approx(2 * low)
    error = by_name(rank_knobs(ws, [finding("x", "model", severity="error")], []))
    info = by_name(rank_knobs(ws, [finding("x", "model", severity="info")], []))
    assert error["max_batch_tokens"].score == pytest.approx(3 * info["max_batch_tokens"].score)
    # A share outside (0, 1] is no share.
    odd = by_name(rank_knobs(ws, [finding("q", "engine.scheduler", share=7)], []))["max_running"].score
    assert odd == pytest.approx(2.0)


def test_broader_and_narrower_components_relate(ws: Workspace) -> None:
    s = by_name(rank_knobs(ws, [finding("prefill_dominates_ttft", "model", severity="info")], []))
    assert s["lm_head_precision"].score == pytest.approx(0.5)  # model.lm_head under model
    assert s["max_batch_tokens"].score == pytest.approx(0.5)  # [engine.scheduler, model]: half its components
    assert s["max_running"].score == 0
    s = by_name(rank_knobs(ws, [finding("f", "engine", severity="info")], []))
    assert s["step_delay_ms"].score == pytest.approx(0.5)  # engine.loop under engine
    assert s["max_running"].score == pytest.approx(0.5)


def test_a_named_knob_ranks_first(ws: Workspace) -> None:
    findings = [
        finding("queue_dominates_ttft", "engine.scheduler", severity="error", share=1.0),
        finding("mismatch", "model.lm_head", severity="info", knob="torch_threads"),
        finding("roofline", None, severity="info", knob="lm_head_precision=tf32"),
    ]
    scores = rank_knobs(ws, findings, [])
    # Both named knobs come before max_running (an error at its own component, 3 points);
    # lm_head_precision also sits at the mismatch's component.
    assert [s.name for s in scores[:3]] == ["lm_head_precision", "torch_threads", "max_running"]
    assert scores[0].named and scores[1].named and not scores[2].named
    assert scores[2].score == pytest.approx(3.0) and scores[1].score == pytest.approx(4.0)
    assert by_name(scores)["lm_head_precision"].kinds == ("roofline", "mismatch")
    assert "roofline names it" in by_name(scores)["lm_head_precision"].explain()
    # An unknown knob name is ignored.
    assert all(not s.named for s in rank_knobs(ws, [finding("x", knob="nope")], []))


def test_findings_without_a_location_score_nothing(ws: Workspace) -> None:
    assert all(s.score == 0 for s in rank_knobs(ws, [finding("failed_requests")], []))


def test_failing_gates_favour_their_scenario(ws: Workspace) -> None:
    chat = finding("queue_dominates_ttft", "engine.scheduler", scenario="short-chat")
    prefill = finding("prefill_dominates_ttft", "model", scenario="long-prefill")
    gates = [GateResult(name="t", gate="p99_ttft_ms<=1.1 @short-chat x baseline", kind="relative", outcome="fail"),
             GateResult(name="p", gate="total_token_throughput>=0.95 @long-prefill x baseline", kind="relative",
                        outcome="pass")]
    plain = by_name(rank_knobs(ws, [chat, prefill], []))
    gated = by_name(rank_knobs(ws, [chat, prefill], gates))
    assert gated["max_running"].score == plain["max_running"].score
    assert gated["lm_head_precision"].score == pytest.approx(plain["lm_head_precision"].score / 2)


def test_ties_break_by_name_and_order_is_deterministic(ws: Workspace) -> None:
    findings = [finding("a", "engine.scheduler"), finding("b", "model", severity="info")]
    first = rank_knobs(ws, findings, [])
    again = rank_knobs(ws, list(reversed(findings)), [])
    assert [(x.name, x.score) for x in first] == [(x.name, x.score) for x in again]
    s = by_name(first)
    # max_batch_tokens and prefill_chunk share components: equal scores, name order.
    assert s["max_batch_tokens"].score == s["prefill_chunk"].score
    names = [x.name for x in first]
    assert names.index("max_batch_tokens") < names.index("prefill_chunk")
