"""One more batch (extra_batch.py) when the judge cannot decide: the confirmation's gates and an experiment's hypothesis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, OnEvent
from infra_agent.agent.planner import Plan
from infra_agent.ledger import Ledger
from infra_agent.records import Change, Experiment, Hypothesis, Step

from .fake_executor import FakeExecutor, Script, loop_for, new_run, serving, workspace

GATE = [{"name": "chat-throughput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 150}]


class Rounds(FakeExecutor):
    """The candidate windows of the experiments of one ``role`` come from ``rounds``, one list per execute."""

    def __init__(self, rounds: list[list[float]], role: str = "confirm") -> None:
        super().__init__()
        self.rounds = rounds
        self.role = role
        self.calls = 0

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        if exp.role != self.role:
            return super().execute(exp, plan, best, on_event)
        values = self.rounds[min(self.calls, len(self.rounds) - 1)]
        self.calls += 1
        self.plans.append((exp.id, plan))
        return Execution(status="done", candidate={"chat": serving(values)},
                         baseline={"chat": serving([100.0, 101.0, 99.0])}, e2e_runs=6)


def _run(tmp_path: Path, executor: Rounds) -> tuple[Any, list[Experiment]]:
    ws = workspace(tmp_path, criteria=GATE)
    step = Step(hypothesis=Hypothesis(statement="more slots", metric="output_throughput", direction="higher",
                                      min_effect=0.1, scenario="chat"), change=Change(knobs={"max_running": 16}))
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, budget_runs=1, confirm=True)
        loop_for(ws, ledger, run, Script([step]), executor).execute()
        return run, ledger.experiments(run.id)




def test_an_undecided_gate_gets_one_more_round_and_is_decided_on_the_pooled_runs(tmp_path: Path) -> None:
    # One window of three caught a stall: the t-interval over three runs spans the threshold.
    fake = Rounds([[400.0, 400.0, 100.0], [400.0, 401.0, 399.0]])
    run, exps = _run(tmp_path, fake)
    confirm, = [e for e in exps if e.role == "confirm"]
    assert fake.calls == 2
    gate, = [g for g in run.gates_after if g.name == "chat-throughput"]
    assert gate.outcome == "pass" and gate.low is not None and gate.low >= 150, gate
    # The verdict and the stored feedback are over all six windows.
    assert confirm.feedback is not None and confirm.cost.e2e_runs == 12
    samples = confirm.feedback.measurements[0].samples
    assert sorted(samples) == sorted([400.0, 400.0, 100.0, 400.0, 401.0, 399.0])


def test_a_decided_table_is_not_topped_up(tmp_path: Path) -> None:
    fake = Rounds([[400.0, 401.0, 399.0]])
    run, _ = _run(tmp_path, fake)
    assert fake.calls == 1
    assert [g.outcome for g in run.gates_after if g.name == "chat-throughput"] == ["pass"]


def test_a_gate_still_undecided_after_the_top_up_stays_inconclusive(tmp_path: Path) -> None:
    # Wild windows in both rounds: one round more, then the table says what it knows.
    fake = Rounds([[400.0, 20.0, 160.0], [10.0, 390.0, 150.0]])
    run, _ = _run(tmp_path, fake)
    assert fake.calls == 2
    gate, = [g for g in run.gates_after if g.name == "chat-throughput"]
    assert gate.outcome == "inconclusive" and gate.more_samples is not None


def _experiment(tmp_path: Path, executor: Rounds, **opts: Any) -> Experiment:
    ws = workspace(tmp_path, criteria=[])
    step = Step(hypothesis=Hypothesis(statement="more slots", metric="output_throughput", direction="higher",
                                      min_effect=0.1, scenario="chat"), change=Change(knobs={"max_running": 16}))
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, budget_runs=1, **opts)
        loop_for(ws, ledger, run, Script([step]), executor).execute()
        exp, = [e for e in ledger.experiments(run.id) if e.role == "experiment"]
    return exp


def test_an_undecided_hypothesis_gets_one_more_round_and_its_verdict_pools_both(tmp_path: Path) -> None:
    # +20% with one disturbed window: the first round's interval reaches below +10%.
    fake = Rounds([[120.0, 121.0, 105.0], [120.0, 119.0, 121.0]], role="experiment")
    exp = _experiment(tmp_path, fake)
    assert fake.calls == 2
    assert exp.verdict is not None and exp.verdict.outcome == "supported" and exp.accepted, exp.verdict
    assert exp.cost.e2e_runs == 12 and exp.feedback is not None
    assert sorted(exp.feedback.measurements[0].samples) == sorted([120.0, 121.0, 105.0, 120.0, 119.0, 121.0])


def test_without_top_up_the_first_round_decides(tmp_path: Path) -> None:
    fake = Rounds([[120.0, 121.0, 105.0], [120.0, 119.0, 121.0]], role="experiment")
    exp = _experiment(tmp_path, fake, top_up=False)
    assert fake.calls == 1
    assert exp.verdict is not None and exp.verdict.outcome == "inconclusive" and not exp.accepted


def test_a_decided_hypothesis_is_not_topped_up(tmp_path: Path) -> None:
    fake = Rounds([[50.0, 51.0, 49.0]], role="experiment")
    exp = _experiment(tmp_path, fake)
    assert fake.calls == 1
    assert exp.verdict is not None and exp.verdict.outcome == "refuted"
