"""The search scores a trial as the judge measures it: the candidate against its interleaved
parent (per-window pairs), chained from the baseline; never the candidate's absolute value.

Feedback is built directly: each side of an experiment holds one sample per measured window,
index-paired (pair i ran side by side).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from optuna.trial import TrialState

from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search import SearchProposer
from infra_agent.agent.proposers.search_objective import paired_ratio
from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier
from infra_agent.records import (
    Change,
    Experiment,
    GateResult,
    Hypothesis,
    RunRecord,
)
from infra_agent.workspace import load_workspace, metric_direction
from infra_agent.workspace.models import Workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "refstack-serving"
SCENARIO = "short-chat"
QUEUE = Finding(kind="queue_dominates_ttft", severity="warning", message="requests wait",
                location=Location(component="engine.scheduler"), evidence={"share": 0.8, "scenario": SCENARIO})


@pytest.fixture(scope="module")
def ws() -> Workspace:
    return load_workspace(EXAMPLE)


def windows(metric: str, samples: list[float]) -> Feedback:
    return Feedback(probe="serving", tier=Tier.e2e, measurements=[
        Measurement.from_samples(metric, "x", samples, better="higher", component="client", scenario=SCENARIO)])


def exp(ws: Workspace, id_: str, parent: str | None, knobs: dict, cand: list[float], base: list[float] | None,
        metric: str = "output_throughput") -> Experiment:
    config = {**ws.resolve_knobs(), **knobs}
    return Experiment(id=id_, run_id="r1", seq=int(id_[1:]), parent=parent, role="experiment" if parent else "baseline",
                      proposer="search" if parent else "-", status="done", knobs=config,
                      change=Change(knobs=knobs, description="search: " + ", ".join(f"{k}={v}" for k, v in knobs.items())),
                      hypothesis=Hypothesis(statement="s", metric=metric, direction=metric_direction(metric) or "higher",
                                            scenario=SCENARIO),
                      feedback=windows(metric, cand), baseline_feedback=windows(metric, base) if base is not None else None)


def state(ws: Workspace, history: list[Experiment], gate: str) -> LoopState:
    return LoopState(workspace=ws, run=RunRecord(id="r1", workspace=str(ws.root), proposer="search", started_at=0.0),
                     best=history[0], history=history, gates=[GateResult(name="g", gate=gate, kind="absolute", outcome="fail")],
                     feedback=[Feedback(probe="serving", tier=Tier.e2e, findings=[QUEUE])])


def test_paired_ratio_is_the_geometric_mean_of_the_per_window_ratios() -> None:
    cand, base = windows("output_throughput", [110.0, 220.0, 90.0]), windows("output_throughput", [100.0, 200.0, 100.0])
    assert paired_ratio(cand, base, "output_throughput", SCENARIO) == pytest.approx((1.1 * 1.1 * 0.9) ** (1 / 3))
    assert paired_ratio(cand, None, "output_throughput", SCENARIO) is None  # a check-only experiment
    assert paired_ratio(windows("output_throughput", [4.0, 9.0]), windows("output_throughput", [1.0, 4.0, 9.0]),
                        "output_throughput", SCENARIO) == pytest.approx(6.0 / 36 ** (1 / 3))  # unequal counts


def test_a_quiet_moment_is_not_a_new_best(ws: Workspace) -> None:
    base = exp(ws, "e0", None, {}, [500.0, 500.0, 500.0], None)
    # e1: both sides ran in a quiet moment; the candidate's absolute throughput rose 20%, the pairs did not.
    quiet = exp(ws, "e1", "e0", {"max_running": 64}, [600.0, 610.0, 590.0], [600.0, 610.0, 590.0])
    # e2: a busy moment; its absolute value is below the baseline's, but it beat its parent in every pair.
    busy = exp(ws, "e2", "e0", {"max_running": 16}, [450.0, 440.0, 460.0], [400.0, 391.0, 409.0])
    p = SearchProposer(seed=0)
    p.restore([base, quiet], workspace=ws)
    p.propose(state(ws, [base, quiet], f"output_throughput>=2000 @{SCENARIO}"))
    assert p.score("e0") == 1.0 and p.score("e1") == pytest.approx(1.0)
    assert p.best_value() == pytest.approx(500.0)  # scores are in the baseline's unit: 1.0 x 500
    assert p.stale_trials() == 1  # e1 improved nothing
    p.observe(state(ws, [base, quiet, busy], f"output_throughput>=2000 @{SCENARIO}"), busy)
    assert p.score("e2") == pytest.approx((450 / 400 * 440 / 391 * 460 / 409) ** (1 / 3))
    assert p.best_value() == pytest.approx(500.0 * p.score("e2"))  # type: ignore[operator]
    assert p.study is not None and p.study.best_trial.user_attrs.get("experiment") != "e1"
    # Chained: an experiment on top of e2 scores e2's score x its own ratio against e2.
    on_top = exp(ws, "e3", "e2", {"max_batch_tokens": 1024}, [300.0, 300.0, 300.0], [400.0, 400.0, 400.0])
    p.observe(state(ws, [base, quiet, busy, on_top], f"output_throughput>=2000 @{SCENARIO}"), on_top)
    assert p.score("e3") == pytest.approx(p.score("e2") * 0.75)  # type: ignore[operator]
    # A resumed run scores the same.
    q = SearchProposer(seed=0)
    q.restore([base, quiet, busy, on_top], workspace=ws)
    q.propose(state(ws, [base, quiet, busy, on_top], f"output_throughput>=2000 @{SCENARIO}"))
    assert [q.score(e) for e in ("e0", "e1", "e2", "e3")] == [pytest.approx(p.score(e)) for e in ("e0", "e1", "e2", "e3")]


def test_a_minimised_metric_scores_its_ratio_and_the_study_minimises(ws: Workspace) -> None:
    metric = "p99_ttft_ms"
    base = exp(ws, "e0", None, {}, [100.0, 100.0, 100.0], None, metric)
    # Lower latency in every pair (absolute values above the baseline's: a busy moment).
    better = exp(ws, "e1", "e0", {"max_running": 64}, [150.0, 160.0, 140.0], [200.0, 200.0, 200.0], metric)
    worse = exp(ws, "e2", "e0", {"max_running": 16}, [90.0, 90.0, 90.0], [60.0, 60.0, 60.0], metric)
    p = SearchProposer(seed=0)
    p.restore([base, better, worse], workspace=ws)
    p.propose(state(ws, [base, better, worse], f"{metric}<=10 @{SCENARIO}"))
    assert p.study is not None and p.study.direction.name == "MINIMIZE"
    assert p.score("e1") == pytest.approx((0.75 * 0.8 * 0.7) ** (1 / 3)) and p.score("e2") == pytest.approx(1.5)
    assert p.best_value() == pytest.approx(100.0 * p.score("e1"))  # type: ignore[operator]


def test_without_a_parent_side_the_reading_is_the_candidates(ws: Workspace) -> None:
    base = exp(ws, "e0", None, {}, [500.0, 500.0, 500.0], None)
    check_only = exp(ws, "e1", "e0", {"max_running": 64}, [550.0], None)
    p = SearchProposer(seed=0)
    p.restore([base, check_only], workspace=ws)
    p.propose(state(ws, [base, check_only], f"output_throughput>=2000 @{SCENARIO}"))
    assert p.score("e1") == pytest.approx(1.1) and p.best_value() == pytest.approx(550.0)
    assert p.study is not None
    assert sorted(t.value for t in p.study.trials if t.state == TrialState.COMPLETE) == [500.0, 550.0]  # type: ignore[type-var]
