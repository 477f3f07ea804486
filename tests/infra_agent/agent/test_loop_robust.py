"""The loop on bad data and after a kill, with an in-process executor (no servers): every bad
step becomes a recorded experiment and the loop goes on; a resumed run loses and repeats nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.planner import Plan, Planner
from infra_agent.agent.steps import new_experiment
from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Tier
from infra_agent.judge.accept import held_on_parent, judge, update_table
from infra_agent.ledger import Ledger
from infra_agent.records import (
    Change,
    Experiment,
    GateResult,
    Hypothesis,
    ProbeCall,
    Step,
)

from .fake_executor import FakeExecutor, Script, loop_for, new_run, serving, workspace

UNIT = {"name": "unit", "probe": "command", "components": ["engine"], "config": {"command": "true"}}


def _step(knobs: dict | None = None, metric: str = "output_throughput", direction: str = "higher",  # type: ignore[type-arg]
          scenario: str | None = "chat", **kw: object) -> Step:
    return Step(hypothesis=Hypothesis(statement="s", metric=metric, direction=direction, min_effect=0.1,  # type: ignore[arg-type]
                                      scenario=scenario), change=Change(knobs=knobs or {}), **kw)


def test_bad_steps_are_recorded_and_the_loop_goes_on(tmp_path: Path) -> None:
    ws = workspace(tmp_path, checks=[UNIT])
    steps: list[Step | Exception] = [
        _step({"no_such_knob": 3}),                              # unknown knob
        _step({"max_running": 999}),                             # outside the domain
        _step({"max_running": 8}, scenario="nope"),              # scenario the workspace lacks
        _step({"max_running": 16}),                              # a good one
        _step({"max_running": 6}, probe="kernel"),               # a probe no check uses
        _step({"max_running": 5}, probe="unit", probe_config={"bogus": 1}),  # a config the probe refuses
        _step({}),                                               # changes nothing
        _step({"max_running": "16"}),                            # the value the best already has, as text
    ]
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, budget_runs=20)
        loop_for(ws, ledger, run, Script(steps), FakeExecutor()).execute()
        exps = [e for e in ledger.experiments(run.id) if e.role == "experiment"]
    got = [(e.status, e.error or "") for e in exps]
    assert len(got) == len(steps)
    assert got[0][0] == "rejected" and "no_such_knob" in got[0][1] and "knobs" in got[0][1]
    assert got[1][0] == "rejected" and "max_running" in got[1][1]
    assert got[2][0] == "error" and "scenario 'nope'" in got[2][1] and "chat" in got[2][1]
    assert got[3][0] == "done" and exps[3].accepted
    assert got[4][0] == "error" and "probe 'kernel'" in got[4][1] and "unit" in got[4][1]
    assert got[5][0] == "error" and "bogus" in got[5][1]
    assert got[6][0] == "rejected" and "no knob values and no diff" in got[6][1]
    assert got[7][0] == "rejected" and f"the value(s) {exps[3].id} already runs with" in got[7][1]
    assert run.status == "done" and run.best == exps[3].id


def test_a_repeated_change_on_the_same_parent_is_not_run_twice(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    # Refuted (throughput falls), so the best stays the baseline and the repeat has the same parent.
    steps: list[Step | Exception] = [_step({"max_running": 2}), _step({"max_running": "2"})]
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        loop_for(ws, ledger, run, Script(steps), FakeExecutor()).execute()
        exps = [e for e in ledger.experiments(run.id) if e.role == "experiment"]
    assert exps[0].status == "done" and not exps[0].accepted
    assert exps[1].status == "rejected" and f"already tried on e0 in experiment {exps[0].id}" in (exps[1].error or "")


def test_a_proposer_stuck_on_a_bad_step_ends_the_run_without_a_budget(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, budget_runs=None)
        loop_for(ws, ledger, run, Script([_step({})], repeat_last=True), FakeExecutor()).execute()
        n = len([e for e in ledger.experiments(run.id) if e.role == "experiment"])
    assert n == 5 and "5 proposals in a row that could not run" in run.message


def test_a_proposer_that_fails_ends_the_run_as_an_error_not_a_crash(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    steps: list[Step | Exception] = [_step({"max_running": 16}), InfraAgentError("endpoint http://x gone")]
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        loop_for(ws, ledger, run, Script(steps), FakeExecutor()).execute()
        stored = ledger.get_run(run.id)
    assert stored.status == "error" and "script proposer failed: endpoint http://x gone" in stored.message
    assert stored.best == "e1"


def test_forced_probes_resolve_to_a_workspace_check(tmp_path: Path) -> None:
    ws = workspace(tmp_path, checks=[UNIT])
    for name in ("unit", "command"):
        plan = Planner(ws).plan(_step({}, metric="failed_checks", direction="lower", probe=name), [])
        assert (plan.mode, plan.check, plan.probe.name, plan.probe.reason) == ("pair", "unit", "command", "named by the proposer")
    with pytest.raises(InfraAgentError, match=r"probe 'kernel' named by the proposer.*checks: unit"):
        Planner(ws).plan(_step({}, probe="kernel"), [])
    with pytest.raises(InfraAgentError, match=r"scenario 'long' is not among the run's scenarios \(chat\)"):
        Planner(ws, scenarios=["chat"]).plan(_step({}, scenario="long"), [])


def test_a_relative_target_fails_on_the_baseline_instead_of_ending_the_run(tmp_path: Path) -> None:
    # "20% more throughput than the baseline": the baseline against itself is 1.0, so it fails there.
    ws = workspace(tmp_path, criteria=[{"name": "faster", "metric": "output_throughput", "scenario": "chat", "ratio": 1.2}])
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        loop_for(ws, ledger, run, Script([_step({"max_running": 16})]), FakeExecutor()).execute()
        exps = ledger.experiments(run.id)
    assert run.gates_before[0].outcome == "fail" and "does not meet >= 1.2" in run.gates_before[0].message
    # Without the fix the run stopped at once, "every gate passes"; now it does once e1 passes it.
    assert [e.status for e in exps] == ["done", "done"] and exps[1].accepted
    assert run.message == "every gate passes" and run.gates_after[0].measured_in == "e1"


def test_a_relative_guard_blocks_a_regression_from_the_first_step(tmp_path: Path) -> None:
    # Throughput may not fall below 0.95x: on the baseline it is "skipped" (holds by definition),
    # which must still count as held when a supported hypothesis costs 50% of it.
    ws = workspace(tmp_path, criteria=[{"name": "no-regress", "metric": "output_throughput", "scenario": "chat", "ratio": 0.95},
                                       {"name": "ttft", "metric": "p99_ttft_ms", "scenario": "chat", "value": 1}])
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        loop_for(ws, ledger, run, Script([_step({"max_running": 2}, direction="lower")]), FakeExecutor()).execute()
        exp = ledger.experiments(run.id)[1]
    assert run.gates_before[0].outcome == "skipped"
    assert exp.verdict is not None and exp.verdict.outcome == "supported" and not exp.accepted
    assert "breaks no-regress" in exp.verdict.message


def _gate(outcome: str, by: str) -> GateResult:
    return GateResult(name="p99", gate="p99_ttft_ms<=500 @chat", kind="absolute", outcome=outcome, measured_in=by)  # type: ignore[arg-type]


def test_a_gate_left_inconclusive_by_an_accepted_step_stays_guarded(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    shown = update_table(update_table({}, [_gate("pass", "e0")]), [_gate("inconclusive", "e1")])
    held = update_table(update_table({}, [_gate("pass", "e0")], True), [_gate("inconclusive", "e1")], True)
    assert shown["p99"].outcome == "inconclusive" and held["p99"].measured_in == "e0"
    assert held_on_parent(ws, _gate("fail", "e2"), held) and not held_on_parent(ws, _gate("fail", "e2"), shown)
    # Judged through the loop's rule: the hypothesis holds, the guarded gate breaks.
    ws2 = workspace(tmp_path / "b", criteria=[{"name": "p99", "metric": "output_throughput", "scenario": "chat",
                                               "op": ">=", "value": 90}])
    exp = Experiment(id="e2", run_id="r", seq=2, parent="e1", hypothesis=_step({}, direction="lower").hypothesis)
    from infra_agent.agent.executors.base import Execution

    ex = Execution(status="done", candidate={"chat": serving([50, 51, 49])}, baseline={"chat": serving([92, 93, 91])})
    plan = Plan(ProbeCall(name="serving", tier=Tier.e2e), "ab", scenarios=["chat"])
    v = judge(ws2, exp, ex, plan, held)
    assert v.outcome == "supported" and not v.accepted and "breaks p99" in v.message


def test_resume_measures_a_failed_baseline_again(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        loop_for(ws, ledger, run, Script([]), FakeExecutor(baseline_error="no GPU here")).execute()
        assert run.status == "error" and "no GPU here" in run.message
        run.status = "running"
        loop_for(ws, ledger, run, Script([_step({"max_running": 16})]), FakeExecutor()).execute()
        exps = ledger.experiments(run.id)
    assert [(e.id, e.status) for e in exps] == [("e0", "done"), ("e1", "done")]
    assert exps[0].verdict is not None and exps[0].error is None and run.gates_before


def _killed_after_accepting(tmp_path: Path, ledger: Ledger, ws: object) -> tuple[object, FakeExecutor]:
    run = new_run(tmp_path, ledger, budget_runs=1)
    loop_for(ws, ledger, run, Script([_step({"max_running": 16})]), FakeExecutor()).execute()
    stored = ledger.get_run(run.id)
    assert stored.best == "e1"
    # As if killed between saving e1 and saving the run record.
    stored.best, stored.status = "e0", "running"
    ledger.save_run(stored)
    return stored, FakeExecutor()


def test_resume_after_a_kill_between_experiment_and_run_record_keeps_the_accepted_best(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    with Ledger.for_workspace(ws.root) as ledger:
        run, fake = _killed_after_accepting(tmp_path, ledger, ws)
        loop_for(ws, ledger, run, Script([]), fake).execute()  # type: ignore[arg-type]
        assert ledger.get_run(run.id).best == "e1"  # type: ignore[attr-defined]
    assert fake.restored == ["e1"]  # the run's branch is made to match the best


def test_resume_runs_a_proposed_step_with_the_probe_it_named(tmp_path: Path) -> None:
    ws = workspace(tmp_path, checks=[UNIT])
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        loop = loop_for(ws, ledger, run, Script([]), FakeExecutor())
        loop.execute()
        # Killed right after the proposal was saved, before it started.
        exp = new_experiment(loop, _step({"max_running": 8}, metric="failed_checks", direction="lower", probe="unit"),
                             loop.best())
        assert ledger.get_experiment(exp.id, run.id).status == "proposed"
        fake = FakeExecutor()
        run.status = "running"
        loop_for(ws, ledger, run, Script([]), fake).execute()
        again = ledger.get_experiment(exp.id, run.id)
    (exp_id, plan), = fake.plans
    assert exp_id == exp.id and plan.check == "unit" and plan.probe.reason == "named by the proposer"
    assert again.status == "done"


def test_resume_reruns_an_interrupted_confirmation_under_its_own_id(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, budget_runs=1, confirm=True)
        hyp = Hypothesis(statement="c", metric="output_throughput", direction="higher", scenario="chat")
        loop_for(ws, ledger, run, Script([_step({"max_running": 16})]), FakeExecutor()).execute()
        first = [e for e in ledger.experiments(run.id) if e.role == "confirm"]
        assert [e.status for e in first] == ["done"]
        # As if the confirmation had been killed: unfinished, and the run not done.
        dead = first[0].model_copy(update={"status": "interrupted", "verdict": None, "hypothesis": hyp})
        ledger.save_experiment(dead)
        run.status, run.gates_after = "running", []
        loop_for(ws, ledger, run, Script([]), FakeExecutor()).execute()
        confirms = [e for e in ledger.experiments(run.id) if e.role == "confirm"]
    assert [(e.id, e.status) for e in confirms] == [(dead.id, "done")]
    assert confirms[0].verdict is not None and run.gates_after[0].measured_in == dead.id


def test_an_unexpected_failure_leaves_the_run_marked_error_not_running(tmp_path: Path) -> None:
    ws = workspace(tmp_path)

    class Broken(FakeExecutor):
        def execute(self, *a: object, **k: object):  # type: ignore[no-untyped-def, override]
            raise RuntimeError("bug")

    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger)
        with pytest.raises(RuntimeError):
            loop_for(ws, ledger, run, Script([_step({"max_running": 16})]), Broken()).execute()
        stored = ledger.get_run(run.id)
    assert stored.status == "error" and "RuntimeError: bug" in stored.message and stored.finished_at is not None


def test_the_verdict_of_a_metric_with_odd_characters_is_computed() -> None:
    h = Hypothesis(statement="s", metric="lat=ms", direction="higher", min_effect=0.1, scenario="chat")
    from infra_agent.judge.gates import hypothesis_outcome

    outcome, gate = hypothesis_outcome(h, serving([120, 121, 119], metric="lat=ms"), serving([100, 101, 99], metric="lat=ms"))
    assert outcome == "supported" and gate.gate == "lat=ms>=1.1"
