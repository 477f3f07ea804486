"""The agent loop: Workspace -> Proposer -> Step -> Planner -> Executor -> Probe -> Feedback -> Judge -> Ledger.

1. The baseline is measured once (the criteria's scenarios, ``pairs`` windows each, and
   every check): that is the gate table *before*.
2. Until every gate passes, the budget ends or the proposer has nothing left: the
   proposer reads the state and returns a step; the planner picks the cheapest probe
   and the cheap gates; the executor runs them; the judge gives the verdict; the
   ledger records the experiment (before it runs, while it runs, and when it ends).
3. When something was accepted, a confirmation A/B of the best against the baseline
   gives the gate table *after*, relative criteria included.

Every state change is written to the ledger first, so ``resume`` continues a killed
run without losing or repeating a finished experiment.
"""

from __future__ import annotations

import time
from typing import Any

from infra_agent.agent.baseline import run_baseline
from infra_agent.agent.conclusion import PASSING, StopKind, StopReason, conclude
from infra_agent.agent.confirm import confirm_best
from infra_agent.agent.executors.base import Executor
from infra_agent.agent.history import accepted_path, by_id, gate_table, latest_feedback
from infra_agent.agent.judging import commit_message, failure_finding
from infra_agent.agent.look_again import look_again, looked_at
from infra_agent.agent.planner import Plan, Planner
from infra_agent.agent.progress import RunProgress
from infra_agent.agent.proposers.base import LoopState, Proposer
from infra_agent.agent.rounds import (
    judge_in_rounds,
    most_promising_open,
    reopen,
    sample_plan,
)
from infra_agent.agent.screening import open_match, screen
from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback, Tier
from infra_agent.judge.accept import check_runs
from infra_agent.judge.pooling import side_feedback
from infra_agent.records import (
    Cost,
    Experiment,
    GateResult,
    ProbeCall,
    RunRecord,
    Step,
)
from infra_agent.vocabulary import FindingKind


class Loop:
    def __init__(self, workspace: Any, ledger: Any, run: RunRecord, proposer: Proposer, executor: Executor,
                 planner: Planner, progress: RunProgress) -> None:
        self.ws, self.ledger, self.run, self.proposer = workspace, ledger, run, proposer
        self.executor, self.planner, self.progress = executor, planner, progress
        self.history: list[Experiment] = ledger.experiments(run.id)
        self.started = time.monotonic()
        self.opts = run.options
        # A run killed between saving an accepted experiment and saving the run record: the
        # accepted experiments form a chain, so the last one is the best.
        accepted = [e for e in self.history if e.role == "experiment" and e.finished and e.accepted]
        if accepted and self.run.best != accepted[-1].id:
            self.run.best = accepted[-1].id

    # ------------------------------------------------------------ state

    def _by_id(self, exp_id: str | None) -> Experiment | None:
        return by_id(self.history, exp_id)

    def _best(self) -> Experiment:
        best = self._by_id(self.run.best) or self._by_id(self.run.baseline)
        assert best is not None
        return best

    def _table(self, decisive: bool = False) -> dict[str, GateResult]:
        return gate_table(self.history, decisive)

    def _state(self) -> LoopState:
        best = self._best()
        # A look-again on the best re-measured its checks: their findings are the newest.
        looked = looked_at(self.history, best)
        fbs = latest_feedback(accepted_path(self.history, best) + ([looked] if looked and looked.finished else []))
        return LoopState(workspace=self.ws, run=self.run, best=best, history=list(self.history), feedback=fbs,
                         gates=list(self._table().values()), code_root=self.ws.root,
                         budget_runs_left=self._runs_left(), budget_s_left=self._seconds_left())

    def _runs_left(self) -> int | None:
        n = self.opts.get("budget_runs")
        # A look-again costs a check run, as an experiment does.
        return None if n is None else n - sum(1 for e in self.history if e.role in ("experiment", "diagnose"))

    def _seconds_left(self) -> float | None:
        s = self.opts.get("budget_s")
        return None if s is None else s - self.opts.get("elapsed_s", 0.0) - (time.monotonic() - self.started)

    def _save(self, exp: Experiment) -> None:
        if not any(e is exp for e in self.history):  # identity: equality would compare whole Feedbacks
            self.history = [e for e in self.history if e.id != exp.id] + [exp]
        self.ledger.save_experiment(exp)

    def _save_run(self) -> None:
        self.ledger.save_run(self.run)

    # ------------------------------------------------------------ the run

    def execute(self) -> RunRecord:
        try:
            if not run_baseline(self):
                return self.run
            # What a killed run may have left on the run's branch: make it hold the best's code.
            try:
                self.executor.restore(self._best())
            except InfraAgentError as exc:
                self.progress.line(f"warning: could not restore the run's branch to {self._best().id}: {exc}")
            stop = self._iterate()
            confirmation = confirm_best(self)
            # The conclusion comes from the final gate table, never from the stop reason alone.
            ending = conclude(stop, self.run.gates_after, confirmation, self.run, self.history)
            self.run.status, self.run.message = ending.status, ending.message
            if ending.message != stop.detail:
                self.progress.line(f"conclusion: {ending.message}")
        except KeyboardInterrupt:
            self.run.status, self.run.message = "interrupted", "interrupted (Ctrl-C): resume with `infra-agent resume`"
            raise
        except Exception as exc:
            # Not left "running" in the ledger: the run is over, and resume may continue it.
            self.run.status, self.run.message = "error", f"the loop failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.opts["elapsed_s"] = self.opts.get("elapsed_s", 0.0) + time.monotonic() - self.started
            self.run.finished_at = time.time() if self.run.status != "running" else None
            self._save_run()
        return self.run

    # ------------------------------------------------------------ one step at a time (front ends)

    def ensure_baseline(self) -> bool:
        """Measure the baseline unless it is measured already; False (reason in the run record) if it cannot be."""
        return run_baseline(self)

    def state(self) -> LoopState:
        """What a proposer would see now: the best, the history, the gate table, the budgets."""
        return self._state()

    def run_step(self, step: Step) -> Experiment:
        """Screen, plan, execute, judge and record one step against the current best, as ``execute`` does."""
        return self._take_step(step, self._best())

    def _take_step(self, step: Step, best: Experiment) -> Experiment:
        """A new experiment; or, for the same change on the same parent as an open one
        (inconclusive, promising), one more batch of that experiment: inconclusive is not refuted."""
        again = open_match(self.ws, self.history, best, step)
        if again is not None and self._reopen(again):
            return again
        exp = self._new_experiment(step, best)
        self._run_experiment(exp, step)
        return exp

    def _reopen(self, exp: Experiment) -> bool:
        best = self._by_id(exp.parent) or self._best()
        step = Step(hypothesis=exp.hypothesis, change=exp.change)
        try:
            plan = self.planner.plan(step, [c for k in exp.change.knobs if k in self.ws.knobs
                                            for c in self.ws.knobs[k].components])
        except InfraAgentError:
            return False
        plan.pre_checks = []  # they ran, and passed, in its first batches
        ran = reopen(self.ws, self.executor, exp, plan, best, self._table(decisive=True),
                     take=lambda ex: self._take(exp, ex, plan), say=self.progress.line, on_event=self.progress.event)
        self._finish(exp, best, plan)
        return ran

    def _stop_reason(self) -> StopReason | None:
        table = self._table()
        if table and all(g.outcome in PASSING for g in table.values()) and not self.opts.get("keep_going"):
            if not any(g.outcome == "pass" for g in table.values()):
                return StopReason(StopKind.GUARDS_ONLY, "every gate holds: the only criteria are relative guards, which "
                                  "hold on the baseline by definition (add an absolute criterion or a target ratio, or "
                                  "use --keep-going)")
            return StopReason(StopKind.GATES_PASS, "every gate passes")
        left = self._runs_left()
        if left is not None and left <= 0:
            return StopReason(StopKind.BUDGET_RUNS, "the experiment budget is spent")
        secs = self._seconds_left()
        if secs is not None and secs <= 0:
            return StopReason(StopKind.BUDGET_TIME, "the time budget is spent")
        return None

    def _iterate(self) -> StopReason:
        # An experiment that was in flight when the run died is run again, as it was proposed.
        for exp in [e for e in self.history if e.role == "experiment" and not e.finished]:
            self._run_experiment(exp, None)
        screened = 0  # rejected before running, in a row
        while (reason := self._stop_reason()) is None:
            state = self._state()
            # An open experiment on the best (inconclusive, promising) gets its one more batch
            # before anything new is tried: a right but undecided change is not dropped.
            if self._reopen_best_open(state.best):
                continue
            try:
                step = self.proposer.propose(state)
            except InfraAgentError as exc:
                # The proposer cannot go on (an endpoint gone, a bad playbook value): what was
                # accepted so far is still confirmed.
                reason = StopReason(StopKind.PROPOSER_FAILED, f"the {self.proposer.name} proposer failed: {exc}")
                break
            if step is None:
                said = getattr(self.proposer, "stopped_reason", None)
                reason = StopReason(StopKind.NOTHING_LEFT, said or f"the {self.proposer.name} proposer has nothing more to try")
                if look_again(self, state.best, reason.detail):
                    continue
                break
            exp = self._take_step(step, state.best)
            screened = screened + 1 if exp.status in ("rejected", "error") and exp.probe is None else 0
            if screened >= _MAX_SCREENED:
                reason = StopReason(StopKind.SCREENED_OUT, f"the {self.proposer.name} proposer made {screened} proposals "
                                    f"in a row that could not run (last: {exp.error})")
                break
        self.progress.line(f"stopped: {reason}")
        return reason

    def _reopen_best_open(self, best: Experiment) -> bool:
        """The most promising open experiment on ``best`` gets one more batch (once per run)."""
        left = self._runs_left()
        if not self.opts.get("top_up", True) or (left is not None and left < 1):
            return False  # --no-top-up: every experiment is judged on its first batch
        exp = most_promising_open(self.history, best)
        return exp is not None and self._reopen(exp)

    def _new_experiment(self, step: Step, best: Experiment) -> Experiment:
        seq = self.ledger.next_seq(self.run.id)
        exp = Experiment(id=f"e{seq}", run_id=self.run.id, seq=seq, parent=best.id, proposer=self.proposer.name,
                         hypothesis=step.hypothesis, change=step.change, cost=Cost(llm_tokens=step.llm_tokens),
                         base_commit=best.commit or best.base_commit)
        exp.knobs, why = screen(self.ws, step, best, self.history)
        if why is not None:
            exp.status, exp.error = "rejected", why
        elif step.probe is not None:
            # Kept from the proposal, so a run killed before the start re-runs the probe it named.
            exp.probe = ProbeCall(name=step.probe, config=step.probe_config, reason=_NAMED,
                                  tier=Tier.e2e if step.probe == "serving" else Tier.check)
        self._save(exp)
        return exp

    def _run_experiment(self, exp: Experiment, step: Step | None) -> None:
        best = self._by_id(exp.parent) or self._best()
        if exp.status == "rejected":
            self._finish(exp, best)
            return
        exp.verdict = exp.error = exp.commit = None  # run again from the start (resume)
        named = exp.probe is not None and exp.probe.reason == _NAMED
        step = step or Step(hypothesis=exp.hypothesis, change=exp.change,
                            probe=(exp.probe.check or exp.probe.name) if exp.probe and named else None,
                            probe_config=exp.probe.config if exp.probe and named else {})
        changed = [c for k in exp.change.knobs if k in self.ws.knobs for c in self.ws.knobs[k].components]
        try:
            plan = self.planner.plan(step, changed)
        except InfraAgentError as exc:
            exp.probe, exp.status, exp.error = None, "error", f"planner: {exc}"
            self._finish(exp, best)
            return
        # A cheap gate that already fails on the parent says nothing about this change.
        table = self._table()
        plan.pre_checks = [c for c in plan.pre_checks if table.get(c) is None or table[c].outcome == "pass"]
        # The sample-size plan is said before the runs are spent (agent/rounds.py).
        sp = sample_plan(exp, plan, self.history, self.opts)
        exp.sample_plan = sp.as_dict()
        exp.probe, exp.status, exp.started_at = plan.probe, "running", time.time()
        self._save(exp)
        self.progress.experiment(exp, f"{plan.probe.name}/{plan.probe.tier.value}"
                                      + (f" after {len(plan.pre_checks)} cheap gate(s)" if plan.pre_checks else ""))
        if plan.mode == "ab":
            self.progress.line(f"{exp.id} {sp.text()}")
        ex = self.executor.execute(exp, plan, best, self.progress.event)
        self._take(exp, ex, plan)
        if ex.status == "done":
            judge_in_rounds(self.ws, self.executor, exp, plan, best, ex, self._table(decisive=True), sp,
                            take=lambda: self._take(exp, ex, plan), say=lambda text: self.progress.experiment(exp, text),
                            on_event=self.progress.event)
            exp.status = "done"
        else:
            exp.status, exp.error = ex.status, ex.error
            if exp.feedback is None:
                kind = FindingKind.PROBE_TIMEOUT if ex.status == "timeout" else FindingKind.PROBE_ERROR
                exp.feedback = Feedback(probe=plan.probe.name, tier=plan.probe.tier, ok=False, error=ex.error,
                                        findings=[])
                exp.feedback.findings.append(failure_finding(kind, ex.error or ex.status))
        self._finish(exp, best, plan)

    @staticmethod
    def _take(exp: Experiment, ex: Any, plan: Plan) -> None:
        """What the execution measured, onto the experiment: both sides' Feedback, the checks (every
        run of each pooled), the cost."""
        exp.feedback = side_feedback(ex.candidate)
        exp.baseline_feedback = side_feedback(ex.baseline)
        exp.checks = check_runs(ex, plan)
        exp.cost = Cost(wall_s=ex.wall_s, tier=plan.probe.tier, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs,
                        llm_tokens=exp.cost.llm_tokens)

    def _finish(self, exp: Experiment, best: Experiment, plan: Plan | None = None) -> None:
        accepted = exp.verdict is not None and exp.verdict.accepted
        message = commit_message(exp)
        try:
            commit = self.executor.finalize(exp, accepted, message)
        except InfraAgentError as exc:
            commit, accepted = None, False
            exp.error = f"could not commit the accepted change: {exc}"
            if exp.verdict:
                exp.verdict.accepted = False
        exp.commit = commit or (best.commit if accepted else None)
        exp.finished_at = time.time()
        self._save(exp)
        self.planner.learn(self.ledger.probe_costs())  # the next choice sees this run's real cost
        if accepted:
            self.run.best = exp.id
            self._save_run()
        self.proposer.observe(self._state(), exp)
        self.progress.finished(exp, self._best(), list(self._table().values()))

_NAMED = "named by the proposer"
# Proposals in a row rejected before running (invalid, empty, repeated) that end the run:
# a proposer stuck on one bad step must not loop for ever when no budget is set.
_MAX_SCREENED = 5

__all__ = ["Loop"]
