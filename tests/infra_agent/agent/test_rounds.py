"""An experiment judged in rounds: the plan said first, batches until a look decides, and an
open (inconclusive, promising) experiment topped up instead of refused as "already tried"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, OnEvent
from infra_agent.agent.planner import Plan
from infra_agent.ledger import Ledger
from infra_agent.records import Change, Experiment, Hypothesis, Step

from .fake_executor import (
    FakeExecutor,
    Lines,
    Script,
    loop_for,
    new_run,
    serving,
    workspace,
)

GATE = [{"name": "chat-throughput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 1e6}]


class Batches(FakeExecutor):
    """The candidate's windows of each experiment batch come from ``rounds`` in turn; the parent's are ~100."""

    def __init__(self, rounds: list[list[float]]) -> None:
        super().__init__()
        self.rounds = rounds
        self.batches = 0
        self.measured: list[str] = []

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        self.measured.append(exp.id)
        return Execution(status="done", candidate={s: serving([100.0, 103.0, 97.0], s) for s in scenarios}, e2e_runs=3)

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        self.plans.append((exp.id, plan))
        values = self.rounds[min(self.batches, len(self.rounds) - 1)]
        self.batches += 1
        return Execution(status="done", candidate={"chat": serving(values)},
                         baseline={"chat": serving([100.0, 101.0, 99.0])}, e2e_runs=6)


def _step() -> Step:
    return Step(hypothesis=Hypothesis(statement="more slots", metric="output_throughput", direction="higher",
                                      min_effect=0.05, scenario="chat"), change=Change(knobs={"max_running": 16}))


def _run(tmp_path: Path, fake: Batches, steps: list[Any], taus: dict[str, float] | None = None,
         **opts: Any) -> tuple[Any, list[Experiment], list[str]]:
    ws = workspace(tmp_path, criteria=GATE)
    if taus is not None:
        _calibrate(ws.root, taus)
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, **{"budget_runs": 3, **opts})
        loop = loop_for(ws, ledger, run, Script(steps), fake)
        loop.progress = Lines()
        loop.execute()
        return run, ledger.experiments(run.id), loop.progress.lines


def test_the_plan_is_said_first_and_batches_run_until_a_look_decides(tmp_path: Path) -> None:
    # Noisy first batches leave the +5% line undecided; the third batch's look decides it.
    fake = Batches([[130.0, 100.0, 112.0], [125.0, 104.0, 110.0], [120.0, 121.0, 120.0]])
    run, exps, lines = _run(tmp_path, fake, [_step()], max_pairs=12)
    e1 = exps[1]
    assert e1.sample_plan is not None and e1.sample_plan["design"]["looks"] == 4, e1.sample_plan
    assert e1.sample_plan["noise"]["source"] == "3 baseline windows x sqrt(2)"
    said = next(i for i, text in enumerate(lines) if text.startswith("e1 sample plan:"))
    assert "needs ~" in lines[said] and "up to 4 looks of 3 pairs" in lines[said]
    assert fake.batches == 3 and e1.cost.e2e_runs == 18
    assert e1.verdict is not None and e1.verdict.outcome == "supported" and e1.accepted
    assert "18 interleaved pairs" not in e1.verdict.interval and "9 interleaved pairs" in e1.verdict.interval
    assert "look 3 of 4 (Pocock)" in e1.verdict.interval and e1.sample_plan["looks_taken"] == 3


def test_without_top_up_one_look_at_95_percent_decides(tmp_path: Path) -> None:
    fake = Batches([[130.0, 100.0, 112.0]])
    _, exps, _ = _run(tmp_path, fake, [_step()], top_up=False)
    e1 = exps[1]
    assert fake.batches == 1 and e1.sample_plan is not None and e1.sample_plan["design"]["looks"] == 1
    assert e1.verdict is not None and e1.verdict.outcome == "inconclusive" and e1.verdict.interval.startswith("95% ")


def test_an_open_experiment_is_topped_up_not_refused_and_its_parent_not_measured_again(tmp_path: Path) -> None:
    # What an MCP client does: run_experiment on a change, then the same change again.  Cap of one
    # batch: the first call ends inconclusive but promising (open); the second is one more batch
    # of that experiment, pooled: no new experiment, no new baseline.
    fake = Batches([[125.0, 105.0, 112.0], [114.0, 115.0, 116.0]])
    ws = workspace(tmp_path, criteria=GATE)
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, max_pairs=3, look_again=False)
        loop = loop_for(ws, ledger, run, Script([]), fake)
        loop.progress = Lines()
        assert loop.ensure_baseline()
        first = loop.run_step(_step())
        assert first.open and first.verdict is not None and first.verdict.outcome == "inconclusive"
        again = loop.run_step(_step())
        exps = ledger.experiments(run.id)
    assert again.id == first.id == "e1" and [e.role for e in exps] == ["baseline", "experiment"]
    e1 = exps[1]
    assert fake.measured == ["e0"] and fake.batches == 2 and e1.cost.e2e_runs == 12
    assert e1.verdict is not None and "6 interleaved pairs" in e1.verdict.interval
    assert "look 2 of 2 (reopened)" in e1.verdict.interval and e1.sample_plan and e1.sample_plan["reopened"]
    assert any("e1 is open" in text for text in loop.progress.lines)
    assert e1.accepted and run.best == "e1"


def test_the_loop_tops_up_an_open_experiment_once_before_trying_anything_new(tmp_path: Path) -> None:
    # e1 ends open; before the proposer's next step (a different change) the loop gives e1 its
    # one more batch, which decides it; the next step then runs on the new best.
    fake = Batches([[125.0, 105.0, 112.0], [114.0, 115.0, 116.0], [120.0, 121.0, 119.0]])
    other = _step().model_copy(update={"change": Change(knobs={"max_running": 32})})
    run, exps, lines = _run(tmp_path, fake, [_step(), other], max_pairs=3, look_again=False)
    assert [e.id for e in exps] == ["e0", "e1", "e2"]
    e1, e2 = exps[1], exps[2]
    assert e1.sample_plan and e1.sample_plan["reopened"] and e1.accepted
    assert e2.parent == "e1", "the next step ran on the best the top-up made"
    assert lines.index(next(t for t in lines if "e1 is open" in t)) < lines.index(next(t for t in lines
                                                                                      if t.startswith("e2 ")))


def test_an_open_experiment_reopened_once_stays_open_and_the_run_says_no_gain(tmp_path: Path) -> None:
    fake = Batches([[130.0, 100.0, 112.0], [95.0, 130.0, 105.0]])
    run, exps, _ = _run(tmp_path, fake, [_step()], max_pairs=3, look_again=False)
    e1 = exps[1]
    assert fake.batches == 2, "the open experiment got its one more batch"
    assert e1.verdict is not None and e1.verdict.outcome == "inconclusive" and e1.open
    assert e1.sample_plan and e1.sample_plan["reopened"] and not e1.accepted
    # Its estimate is past the 5% line with an interval across it: undecided, not "no gain found".
    assert run.message.startswith("the script proposer has nothing more to try; no gain established: the best "
                                  "configuration tried, e1 (max_running=16)"), run.message
    assert "an interval across its 5% minimum effect (undecided, not refuted)" in run.message
    assert "not every gate passes" in run.message


def test_a_refuted_change_is_still_refused_as_already_tried(tmp_path: Path) -> None:
    fake = Batches([[80.0, 81.0, 79.0]])
    _, exps, _ = _run(tmp_path, fake, [_step(), _step()], look_again=False)
    assert [e.status for e in exps] == ["done", "done", "rejected"]
    assert exps[1].verdict is not None and exps[1].verdict.outcome == "refuted" and not exps[1].open
    assert "already tried" in (exps[2].error or "")


def _calibrate(root: Path, taus: dict[str, float]) -> None:
    """A process-noise calibration of this machine, as ``infra-agent calibrate`` writes it."""
    from infra_agent.serving.noise_record import (
        Machine,
        MetricNoise,
        NoiseCalibration,
        save,
    )

    save(root, NoiseCalibration(scenario="chat", machine=Machine.here(), blocks=6, pairs_per_block=3,
                                metrics={k: MetricNoise(tau=v, within_sd=0.05, df=(5, 12), blocks=6, pairs=18)
                                         for k, v in taus.items()}))


NOISY_THEN_CLEAR = [[130.0, 100.0, 112.0], [125.0, 104.0, 110.0], [120.0, 121.0, 120.0]]


def test_a_calibrated_process_spread_widens_every_look_and_is_said(tmp_path: Path) -> None:
    # The batches that decide at look 3 without it (the first test) stay undecided when two
    # fresh server processes are known to differ by 10%: 4 batches average only 4 offsets.
    fake = Batches(NOISY_THEN_CLEAR)
    run, exps, lines = _run(tmp_path, fake, [_step()], taus={"output_throughput": 0.10}, max_pairs=12,
                            budget_runs=1)
    e1 = exps[1]
    assert any(text.startswith("process noise between fresh servers: output_throughput 10.00%") for text in lines)
    assert e1.sample_plan is not None and e1.sample_plan["process_noise"] == 0.10
    said = next(text for text in lines if text.startswith("e1 sample plan:"))
    assert "10.0% between server processes" in said
    assert fake.batches == 4 and e1.verdict is not None and e1.verdict.outcome == "inconclusive", e1.verdict
    assert "process noise 10.00% over 4 restart(s)" in e1.verdict.interval


def test_process_noise_off_ignores_the_calibration(tmp_path: Path) -> None:
    fake = Batches(NOISY_THEN_CLEAR)
    run, exps, lines = _run(tmp_path, fake, [_step()], taus={"output_throughput": 0.10}, max_pairs=12,
                            budget_runs=1, process_noise="off")
    e1 = exps[1]
    assert not any(text.startswith("process noise between") for text in lines)
    assert fake.batches == 3 and e1.verdict is not None and e1.verdict.outcome == "supported"
    assert "process noise" not in e1.verdict.interval


def test_a_calibration_from_another_machine_is_not_used_and_the_run_says_why(tmp_path: Path) -> None:
    from infra_agent.serving.noise_record import (
        Machine,
        MetricNoise,
        NoiseCalibration,
        save,
    )

    fake = Batches(NOISY_THEN_CLEAR)
    ws = workspace(tmp_path, criteria=GATE)
    save(ws.root, NoiseCalibration(scenario="chat", machine=Machine(hostname="elsewhere", usable_cpus=64), blocks=6,
                                   pairs_per_block=3,
                                   metrics={"output_throughput": MetricNoise(tau=0.1, within_sd=0.05, df=(5, 12),
                                                                             blocks=6, pairs=18)}))
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, budget_runs=1, max_pairs=12)
        loop = loop_for(ws, ledger, run, Script([_step()]), fake)
        loop.progress = Lines()
        loop.execute()
        e1 = ledger.experiments(run.id)[1]
    assert loop.noise is None
    assert any("measured on elsewhere (64 CPUs), not here" in text for text in loop.progress.lines)
    assert e1.verdict is not None and e1.verdict.outcome == "supported"
