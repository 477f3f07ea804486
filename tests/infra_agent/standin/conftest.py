"""A tiny code tree (a git repository), a workspace with an endpoint target, a loop state, and a
stand-in chat server with its base URL (the same tree and workspace as tests/infra_agent/tools)."""

from __future__ import annotations

import pytest

from infra_agent.records import (
    Change,
    Experiment,
    GateResult,
    Hypothesis,
    Verdict,
)

from ..tool_fixtures import baseline, code_root, feedback, state, workspace  # noqa: F401  (fixtures)


def _experiment(step_hypothesis: Hypothesis, knobs: dict, outcome: str = "supported", eid: str = "e1") -> Experiment:
    return Experiment(
        id=eid, run_id="run1", seq=1, parent="e0", proposer="llm", hypothesis=step_hypothesis,
        change=Change(knobs=knobs, diff=None), status="done", knobs={"precision": "fp32", **knobs},
        feedback=feedback(),
        verdict=Verdict(outcome=outcome, effect=1.12, low=1.05, high=1.2, interval="95% bootstrap CI", accepted=True,
                        gates=[GateResult(name="tput", gate="output_throughput>=1.05 @chat", kind="relative",
                                          outcome="pass", value=1.12, low=1.05, high=1.2)]))


@pytest.fixture
def make_experiment():
    """``make_experiment(hypothesis, knobs, outcome=, eid=)``: a finished experiment as the loop records it."""
    return _experiment


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests say where the key comes from; the developer's environment does not leak in."""
    monkeypatch.delenv("INFRA_AGENT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


@pytest.fixture
def make_proposer():
    """``make_proposer(base_url, **options)``: an LLMProposer with small backoff; closed after the test."""
    from infra_agent.agent.proposers.llm import LLMProposer

    made: list[LLMProposer] = []

    def make(base_url: str, **options: object) -> LLMProposer:
        opts: dict = {"backoff_s": 0.01, "timeout_s": 10, "protected": ["tests/**"], **options}
        p = LLMProposer("standin", base_url, **opts)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
