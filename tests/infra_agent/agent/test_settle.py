"""A best whose gate lacks samples, not a change, gets one more batch before anything new
(agent/settle.py): the gate then passes or fails on the pooled runs of that experiment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.agent.settle import lacks_samples
from infra_agent.ledger import Ledger
from infra_agent.records import (
    Change,
    Experiment,
    GateResult,
    GateSpec,
    Hypothesis,
    Step,
)

from .fake_executor import Lines, Script, loop_for, new_run, workspace
from .test_rounds import Batches

# An absolute gate the change clears on average but, on three windows, not surely.
GATE = [{"name": "chat-throughput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 113.0}]
# +15% against ~100, supported at the first look; the gate on these three windows reads 115 with
# an interval across 113.
FIRST = [116.0, 113.6, 115.4]


def _steps() -> list[Step]:
    return [Step(hypothesis=Hypothesis(statement=f"{n} slots", metric="output_throughput", direction="higher",
                                       min_effect=0.05, scenario="chat"), change=Change(knobs={"max_running": n}))
            for n in (16, 32)]


def _run(tmp_path: Path, fake: Batches, **opts: Any) -> tuple[Any, list[Experiment], list[str]]:
    ws = workspace(tmp_path, criteria=GATE)
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, **{"budget_runs": 3, "max_pairs": 3, "look_again": False, **opts})
        loop = loop_for(ws, ledger, run, Script(_steps()), fake)
        loop.progress = Lines()
        loop.execute()
        return run, ledger.experiments(run.id), loop.progress.lines


def _gate(exp: Experiment) -> GateResult:
    assert exp.verdict is not None
    return next(g for g in exp.verdict.gates if g.name == "chat-throughput")


def test_a_gate_left_inconclusive_past_its_threshold_is_settled_on_the_best_not_by_another_change(tmp_path: Path) -> None:
    fake = Batches([FIRST, [115.0, 116.0, 115.5]])
    run, exps, lines = _run(tmp_path, fake)
    e1 = exps[1]
    # The settled gate passes on e1's pooled runs: no second change was tried, no run of the budget spent.
    assert [e.id for e in exps] == ["e0", "e1"], [(e.id, e.role) for e in exps]
    assert fake.batches == 2 and e1.cost.e2e_runs == 12 and e1.accepted
    assert _gate(e1).outcome == "pass" and run.status == "done" and run.best == "e1"
    assert e1.sample_plan is not None and e1.sample_plan["settled"] and e1.sample_plan["looks_taken"] == 2
    said = [t for t in lines if "left inconclusive past the threshold" in t]
    assert said and said[0].startswith("e1: chat-throughput (") and "not another change" in said[0], lines
    assert "stopped: every gate passes" in lines[-1] or any("every gate passes" in t for t in lines), lines


def test_once_per_best_and_never_with_no_top_up(tmp_path: Path) -> None:
    # The batch leaves the gate undecided again: the run goes on to the next change, and e1 is not
    # reopened a third time.
    fake = Batches([FIRST, [119.0, 108.0, 117.0], [104.0, 103.0, 102.0]])
    _, exps, lines = _run(tmp_path, fake)
    assert [e.id for e in exps] == ["e0", "e1", "e2"] and exps[2].parent == "e1"
    assert sum("left inconclusive past the threshold" in t for t in lines) == 1
    assert fake.batches == 4 and exps[1].cost.e2e_runs == 12  # e1: its batch and one more; e2: two looks
    # --no-top-up: judged on its first batch, the gate left as it was.
    fake = Batches([FIRST, [104.0, 103.0, 102.0]])
    _, exps, lines = _run(tmp_path / "no", fake, top_up=False)
    assert not any("left inconclusive past the threshold" in t for t in lines)
    assert _gate(exps[1]).outcome == "inconclusive" and [e.id for e in exps] == ["e0", "e1", "e2"]


def test_only_an_inconclusive_gate_whose_estimate_clears_its_threshold_lacks_samples() -> None:
    spec = GateSpec(kind="check", metric="r", op=">=", threshold=0.95, check="c")

    def gate(outcome: str, value: float | None, s: GateSpec = spec) -> GateResult:
        return GateResult(name="c", gate="check c: r>=0.95", kind="check", spec=s, outcome=outcome, value=value)

    assert lacks_samples(gate("inconclusive", 0.959))
    assert not lacks_samples(gate("inconclusive", 0.937))  # lacks effect: the search's business
    assert not lacks_samples(gate("fail", 0.96)) and not lacks_samples(gate("pass", 0.99))
    assert not lacks_samples(gate("inconclusive", None))
    lower = GateSpec(kind="absolute", metric="p90_ttft_ms", op="<=", threshold=400.0, scenario="chat")
    assert lacks_samples(gate("inconclusive", 390.0, lower)) and not lacks_samples(gate("inconclusive", 410.0, lower))


def test_more_samples_that_undo_the_acceptance_make_the_parent_the_best_again(tmp_path: Path) -> None:
    fake = Batches([FIRST, [100.0, 101.0, 99.0], [101.0, 100.0, 99.5]])
    run, exps, lines = _run(tmp_path, fake)
    e1 = exps[1]
    assert e1.verdict is not None and not e1.accepted and e1.verdict.outcome == "inconclusive", e1.verdict
    assert "e1 is no longer accepted on its pooled runs: the best is e0 again" in lines
    # The next change is judged against the baseline, and the run ends with e0 as its best.
    assert exps[2].parent == "e0" and run.best == "e0"
