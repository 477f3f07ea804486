"""Look again (fresh findings): the proposer has nothing to try while a gate fails, so the loop re-runs the gate's check once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, OnEvent
from infra_agent.agent.proposers.rules import RulesProposer, load_playbook
from infra_agent.feedback import Feedback, Finding, Location, Tier
from infra_agent.ledger import Ledger
from infra_agent.records import Experiment
from infra_agent.vocabulary import FindingKind

from .fake_executor import FakeExecutor, loop_for, new_run, workspace

CHECK = {"name": "gap", "probe": "command", "components": ["engine.scheduler"], "config": {"command": ["true"]}}
PLAYBOOK = (
    "rules:\n"
    "  - name: more-slots\n"
    "    when: {kind: queue_dominates_ttft}\n"
    "    change: {knob: [max_running], multiply: 2}\n"
    "    hypothesis: {statement: 'requests queue: {knob} {old} -> {new}', metric: output_throughput,"
    " direction: higher, scenario: chat}\n")


class Sampled(FakeExecutor):
    """The ``gap`` check always fails; the n-th run of it carries the queueing finding when ``finds(n)``."""

    def __init__(self, finds: Any) -> None:
        super().__init__()
        self.finds = finds
        self.check_runs: list[tuple[str, bool]] = []  # (experiment id, run fresh?)

    def _check(self, exp: Experiment) -> Feedback:
        n = len(self.check_runs)
        self.check_runs.append((exp.id, self.fresh))
        findings = [Finding(kind=FindingKind.QUEUE_DOMINATES_TTFT, message="requests wait for a slot",
                            location=Location(component="engine.scheduler"))] if self.finds(n) else []
        return Feedback(probe="command", tier=Tier.check, ok=False, error="the gap is still there", findings=findings)

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        ex = super().measure(exp, scenarios, repeats, [], on_event, result_metrics)
        ex.checks = {c: self._check(exp) for c in checks}
        ex.probe_runs = len(checks)
        return ex

    def execute(self, exp: Experiment, plan: Any, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        ex = super().execute(exp, plan, best, on_event)
        ex.checks = {"gap": self._check(exp)}
        return ex


def _run(tmp_path: Path, fake: Sampled, **opts: Any) -> tuple[Any, list[Experiment]]:
    ws = workspace(tmp_path, criteria=[], checks=[CHECK])
    (tmp_path / "playbook.yaml").write_text(PLAYBOOK)
    proposer = RulesProposer(load_playbook(tmp_path / "playbook.yaml"))
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, **opts)
        loop_for(ws, ledger, run, proposer, fake).execute()
        return run, ledger.experiments(run.id)


def test_a_check_rerun_on_the_best_finds_what_the_first_run_missed_and_the_proposer_acts_on_it(tmp_path: Path) -> None:
    # The baseline's run of the check carries no finding; every later run does.
    fake = Sampled(lambda n: n >= 1)
    run, exps = _run(tmp_path, fake, budget_runs=2)
    assert [e.role for e in exps] == ["baseline", "diagnose", "experiment"]
    base, look, exp = exps
    assert look.parent == base.id and look.change.empty and look.knobs == base.knobs
    assert look.verdict is not None and look.verdict.outcome == "diagnosed"
    assert FindingKind.QUEUE_DOMINATES_TTFT in look.verdict.message and "at engine.scheduler" in look.verdict.message
    # The rerun was fresh (not the executor's cached first run), and it costs a run of the budget.
    assert (look.id, True) in fake.check_runs
    assert exp.change.knobs == {"max_running": 8} and exp.accepted
    # The conclusion names the gate the final table still fails.
    assert run.message.startswith("the experiment budget is spent; not every gate passes: gap fails"), run.message
    # The gate table is the experiments': the look-again's failing check is not a verdict.
    assert all(g.measured_in != look.id for g in run.gates_before)
    # The report shows it in the tree, with its outcome.
    from infra_agent.report import render_html, render_markdown

    md = render_markdown(run, exps)
    assert look.id in md and "diagnosed" in md
    assert look.id in render_html(run, exps)


def test_the_loop_looks_again_once_per_best_and_then_stops_with_the_proposers_reason(tmp_path: Path) -> None:
    fake = Sampled(lambda n: False)
    run, exps = _run(tmp_path, fake, budget_runs=5)
    assert [e.role for e in exps] == ["baseline", "diagnose"]
    assert exps[1].verdict is not None and exps[1].verdict.message == "0 finding(s) on a fresh run"
    assert "no rule of the playbook matches" in run.message
    assert len(fake.check_runs) == 2


def test_each_new_best_gets_its_own_look_again(tmp_path: Path) -> None:
    # Only look-again runs (the odd runs after the baseline's) carry the finding.
    fake = Sampled(lambda n: n % 2 == 1)
    run, exps = _run(tmp_path, fake, budget_runs=4)
    roles = [e.role for e in exps]
    assert roles == ["baseline", "diagnose", "experiment", "diagnose", "experiment"], roles
    assert exps[3].parent == exps[2].id and exps[2].accepted
    assert exps[4].change.knobs == {"max_running": 16} and exps[4].parent == exps[2].id
    # The conclusion names the gate the final table still fails.
    assert run.message.startswith("the experiment budget is spent; not every gate passes: gap fails"), run.message


def test_no_look_again_when_it_would_spend_the_last_run(tmp_path: Path) -> None:
    fake = Sampled(lambda n: n >= 1)
    run, exps = _run(tmp_path, fake, budget_runs=1)
    assert [e.role for e in exps] == ["baseline"]
    assert "no rule of the playbook matches" in run.message


def test_without_look_again_the_run_stops_when_the_proposer_does(tmp_path: Path) -> None:
    fake = Sampled(lambda n: n >= 1)
    run, exps = _run(tmp_path, fake, budget_runs=2, look_again=False)
    assert [e.role for e in exps] == ["baseline"]
    assert "no rule of the playbook matches" in run.message
