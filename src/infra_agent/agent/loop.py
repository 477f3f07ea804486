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

Where each phase lives (each is a function of a :class:`Loop`, using only its public members):

- the baseline: agent/baseline.py;
- one step, from proposal to recorded experiment, and one more batch of an open experiment:
  agent/steps.py (judged in rounds by agent/rounds.py, one batch at a time by
  agent/extra_batch.py);
- fresh findings when the proposer has nothing left (a look-again): agent/fresh_findings.py;
- the confirmation: agent/confirm.py; the run's conclusion from why it stopped: agent/conclusion.py.

The collaborators are typed by agent/protocols.py: Proposer, Executor, StepPlanner, RunLedger.
"""

from __future__ import annotations

import time

from infra_agent.agent.baseline import run_baseline
from infra_agent.agent.conclusion import PASSING, StopKind, StopReason, conclude
from infra_agent.agent.confirm import confirm_best
from infra_agent.agent.fresh_findings import look_again, looked_at
from infra_agent.agent.history import accepted_path, by_id, gate_table, latest_feedback
from infra_agent.agent.judging import commit_message
from infra_agent.agent.progress import RunProgress
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.protocols import Executor, Proposer, RunLedger, StepPlanner
from infra_agent.agent.settle import settle_best
from infra_agent.agent.steps import reopen_best_open, run_experiment, take_step
from infra_agent.errors import InfraAgentError
from infra_agent.judge.process_noise import resolve as resolve_noise
from infra_agent.records import Experiment, GateResult, RunRecord, Step
from infra_agent.workspace.models import Workspace


class Loop:
    """One run's state and its collaborators; the phases (baseline, steps, fresh findings,
    confirmation) are functions of a ``Loop`` that use only its public members."""

    def __init__(self, workspace: Workspace, ledger: RunLedger, run: RunRecord, proposer: Proposer,
                 executor: Executor, planner: StepPlanner, progress: RunProgress) -> None:
        self.ws, self.ledger, self.run, self.proposer = workspace, ledger, run, proposer
        self.executor, self.planner, self.progress = executor, planner, progress
        self.history: list[Experiment] = ledger.experiments(run.id)
        self.started = time.monotonic()
        self.opts = run.options
        # The spread between fresh server processes the judge adds (judge/process_noise.py);
        # why a calibration was not used is said when the run starts.
        self.noise_notes: list[str] = []
        self.noise = resolve_noise(workspace.root, self.opts.get("process_noise", "auto"), self.noise_notes)
        # A run killed between saving an accepted experiment and saving the run record: the
        # accepted experiments form a chain, so the last one is the best.
        accepted = [e for e in self.history if e.role == "experiment" and e.finished and e.accepted]
        if accepted and self.run.best != accepted[-1].id:
            self.run.best = accepted[-1].id

    # ------------------------------------------------------------ state (derived from the history)

    def find(self, exp_id: str | None) -> Experiment | None:
        """The experiment of this run with id ``exp_id`` (None for None or an unknown id)."""
        return by_id(self.history, exp_id)

    def baseline(self) -> Experiment | None:
        return self.find(self.run.baseline)

    def best(self) -> Experiment:
        """The current best: the last accepted experiment, else the baseline."""
        best = self.find(self.run.best) or self.find(self.run.baseline)
        assert best is not None
        return best

    def gate_table(self, decisive: bool = False) -> dict[str, GateResult]:
        """The best configuration's gates (``decisive``: the last pass or fail of each, for the accept rule)."""
        return gate_table(self.history, decisive)

    def state(self) -> LoopState:
        """What a proposer would see now: the best, the history, the gate table, the budgets."""
        best = self.best()
        # A look-again on the best re-measured its checks: their findings are the newest.
        looked = looked_at(self.history, best)
        fbs = latest_feedback(accepted_path(self.history, best) + ([looked] if looked and looked.finished else []))
        return LoopState(workspace=self.ws, run=self.run, best=best, history=list(self.history), feedback=fbs,
                         gates=list(self.gate_table().values()), code_root=self.ws.root,
                         budget_runs_left=self.runs_left(), budget_s_left=self.seconds_left())

    def runs_left(self) -> int | None:
        """Experiments left in ``--budget-runs`` (None: no such budget)."""
        n = self.opts.get("budget_runs")
        # A look-again costs a check run, as an experiment does.
        return None if n is None else n - sum(1 for e in self.history if e.role in ("experiment", "diagnose"))

    def seconds_left(self) -> float | None:
        """Seconds left in ``--budget-s``, over every session of the run (None: no such budget)."""
        s = self.opts.get("budget_s")
        return None if s is None else s - self.opts.get("elapsed_s", 0.0) - (time.monotonic() - self.started)

    # ------------------------------------------------------------ recording (the ledger first)

    def record(self, exp: Experiment) -> None:
        """Save ``exp`` to the ledger and keep it in the history (replacing an older copy)."""
        if not any(e is exp for e in self.history):  # identity: equality would compare whole Feedbacks
            self.history = [e for e in self.history if e.id != exp.id] + [exp]
        self.ledger.save_experiment(exp)

    def record_run(self) -> None:
        self.ledger.save_run(self.run)

    def finish(self, exp: Experiment, best: Experiment) -> None:
        """End ``exp`` (judged against ``best``): keep or discard its code, record it, make it the
        best when accepted, and tell the planner, the proposer and the progress view."""
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
        self.record(exp)
        self.planner.learn(self.ledger.probe_costs())  # the next choice sees this run's real cost
        if accepted:
            self.run.best = exp.id
            self.record_run()
        self.proposer.observe(self.state(), exp)
        self.progress.finished(exp, self.best(), list(self.gate_table().values()))

    # ------------------------------------------------------------ the run

    def execute(self) -> RunRecord:
        for note in self.noise_notes:
            self.progress.line(note)
        if self.noise is not None:
            self.progress.line(self.noise.text())
        if getattr(self.executor, "pool", None) is not None:
            self.progress.line("servers: a configuration's server is kept up across experiments and batches for knob "
                               "changes (no spread between fresh servers to average out)")
        try:
            if not run_baseline(self):
                return self.run
            # What a killed run may have left on the run's branch: make it hold the best's code.
            try:
                self.executor.restore(self.best())
            except InfraAgentError as exc:
                self.progress.line(f"warning: could not restore the run's branch to {self.best().id}: {exc}")
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
            self.record_run()
        return self.run

    # ------------------------------------------------------------ one step at a time (front ends)

    def ensure_baseline(self) -> bool:
        """Measure the baseline unless it is measured already; False (reason in the run record) if it cannot be."""
        return run_baseline(self)

    def run_step(self, step: Step) -> Experiment:
        """Screen, plan, execute, judge and record one step against the current best, as ``execute`` does."""
        return take_step(self, step, self.best())

    # ------------------------------------------------------------ why the loop stops

    def _stop_reason(self) -> StopReason | None:
        table = self.gate_table()
        if table and all(g.outcome in PASSING for g in table.values()) and not self.opts.get("keep_going"):
            if not any(g.outcome == "pass" for g in table.values()):
                return StopReason(StopKind.GUARDS_ONLY, "every gate holds: the only criteria are relative guards, which "
                                  "hold on the baseline by definition (add an absolute criterion or a target ratio, or "
                                  "use --keep-going)")
            return StopReason(StopKind.GATES_PASS, "every gate passes")
        left = self.runs_left()
        if left is not None and left <= 0:
            return StopReason(StopKind.BUDGET_RUNS, "the experiment budget is spent")
        secs = self.seconds_left()
        if secs is not None and secs <= 0:
            return StopReason(StopKind.BUDGET_TIME, "the time budget is spent")
        return None

    def _iterate(self) -> StopReason:
        # An experiment that was in flight when the run died is run again, as it was proposed.
        for exp in [e for e in self.history if e.role == "experiment" and not e.finished]:
            run_experiment(self, exp, None)
        screened = 0  # rejected before running, in a row
        while (reason := self._stop_reason()) is None:
            state = self.state()
            # An open experiment on the best (inconclusive, promising) gets its one more batch
            # before anything new is tried: a right but undecided change is not dropped.
            if reopen_best_open(self, state.best):
                continue
            # A best whose gate lacks samples, not a change, gets them first (agent/settle.py).
            if settle_best(self, state.best):
                continue
            try:
                step = self.proposer.propose(state)
            except InfraAgentError as exc:
                # The proposer cannot go on (an endpoint gone, a bad playbook value): what was
                # accepted so far is still confirmed.
                reason = StopReason(StopKind.PROPOSER_FAILED, f"the {self.proposer.name} proposer failed: {exc}")
                break
            if step is None:
                reason = StopReason(StopKind.NOTHING_LEFT, self.proposer.stopped_reason
                                    or f"the {self.proposer.name} proposer has nothing more to try")
                if look_again(self, state.best, reason.detail):
                    continue
                break
            exp = take_step(self, step, state.best)
            screened = screened + 1 if exp.status in ("rejected", "error") and exp.probe is None else 0
            if screened >= _MAX_SCREENED:
                reason = StopReason(StopKind.SCREENED_OUT, f"the {self.proposer.name} proposer made {screened} proposals "
                                    f"in a row that could not run (last: {exp.error})")
                break
        self.progress.line(f"stopped: {reason}")
        return reason


# Proposals in a row rejected before running (invalid, empty, repeated) that end the run:
# a proposer stuck on one bad step must not loop for ever when no budget is set.
_MAX_SCREENED = 5

__all__ = ["Loop"]
