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

from infra_agent.agent.confirm import run_confirm
from infra_agent.agent.executors.base import Executor
from infra_agent.agent.experiment import (
    Cost,
    Experiment,
    GateResult,
    Hypothesis,
    RunRecord,
    Step,
    Verdict,
)
from infra_agent.agent.judging import (
    commit_message,
    failure_finding,
    gates_of,
    judge,
    side_feedback,
    update_table,
)
from infra_agent.agent.planner import Plan, Planner
from infra_agent.agent.progress import RunProgress
from infra_agent.agent.proposers.base import LoopState, Proposer
from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback
from infra_agent.vocabulary import FindingKind


class Loop:
    def __init__(self, workspace: Any, ledger: Any, run: RunRecord, proposer: Proposer, executor: Executor,
                 planner: Planner, progress: RunProgress) -> None:
        self.ws, self.ledger, self.run, self.proposer = workspace, ledger, run, proposer
        self.executor, self.planner, self.progress = executor, planner, progress
        self.history: list[Experiment] = ledger.experiments(run.id)
        self.started = time.monotonic()
        self.opts = run.options

    # ------------------------------------------------------------ state

    def _by_id(self, exp_id: str | None) -> Experiment | None:
        return next((e for e in self.history if e.id == exp_id), None)

    def _best(self) -> Experiment:
        best = self._by_id(self.run.best) or self._by_id(self.run.baseline)
        assert best is not None
        return best

    def _table(self) -> dict[str, GateResult]:
        table: dict[str, GateResult] = {}
        for e in self.history:
            if e.verdict and (e.role == "baseline" or e.verdict.accepted):
                table = update_table(table, e.verdict.gates)
        return table

    def _path(self) -> list[Experiment]:
        """The accepted path, baseline first."""
        path: list[Experiment] = []
        cur: Experiment | None = self._best()
        while cur is not None:
            path.append(cur)
            cur = self._by_id(cur.parent)
        return path[::-1]

    def _latest_feedback(self) -> list[Feedback]:
        """What is known of the best configuration: the newest serving feedback and the newest run of
        each check along the accepted path (a check that passed later replaces one that failed)."""
        serving: Feedback | None = None
        checks: dict[str, Feedback] = {}
        for e in self._path():
            if e.feedback is not None and e.feedback.probe == "serving":
                serving = e.feedback
            checks.update(e.checks)
        return ([serving] if serving else []) + list(checks.values())

    def _state(self) -> LoopState:
        best = self._best()
        fbs = self._latest_feedback()
        return LoopState(workspace=self.ws, run=self.run, best=best, history=list(self.history), feedback=fbs,
                         gates=list(self._table().values()), code_root=self.ws.root,
                         budget_runs_left=self._runs_left(), budget_s_left=self._seconds_left())

    def _runs_left(self) -> int | None:
        n = self.opts.get("budget_runs")
        return None if n is None else n - sum(1 for e in self.history if e.role == "experiment")

    def _seconds_left(self) -> float | None:
        s = self.opts.get("budget_s")
        return None if s is None else s - self.opts.get("elapsed_s", 0.0) - (time.monotonic() - self.started)

    def _save(self, exp: Experiment) -> None:
        if exp not in self.history:
            self.history = [e for e in self.history if e.id != exp.id] + [exp]
        self.ledger.save_experiment(exp)

    def _save_run(self) -> None:
        self.ledger.save_run(self.run)

    # ------------------------------------------------------------ the run

    def execute(self) -> RunRecord:
        try:
            if not self._baseline_done():
                return self.run
            self._iterate()
            self._confirm()
            self.run.status = "done" if self.run.status == "running" else self.run.status
        except KeyboardInterrupt:
            self.run.status, self.run.message = "interrupted", "interrupted (Ctrl-C): resume with `infra-agent resume`"
            raise
        finally:
            self.opts["elapsed_s"] = self.opts.get("elapsed_s", 0.0) + time.monotonic() - self.started
            self.run.finished_at = time.time() if self.run.status != "running" else None
            self._save_run()
        return self.run

    def _baseline_done(self) -> bool:
        base = self._by_id(self.run.baseline)
        if base is not None and base.finished:
            return True
        seq = self.ledger.next_seq(self.run.id) if base is None else base.seq
        base = base or Experiment(id="e0", run_id=self.run.id, seq=seq, role="baseline", proposer="-",
                                  hypothesis=Hypothesis(statement="baseline: the workspace as given", metric="-", direction="higher"),
                                  knobs=dict(self.ws.resolve_knobs()))
        base.status, base.started_at = "running", time.time()
        self.run.baseline = self.run.best = base.id
        self._save(base)
        self._save_run()
        scenarios = self.opts.get("scenarios") or sorted({c.scenario for c in self.ws.criteria if c.scenario} or self.ws.scenarios)
        metrics = sorted({c.metric for c in self.ws.criteria})
        self.progress.experiment(base, f"serving/e2e x{self.opts['pairs']} on {', '.join(scenarios)} + {len(self.ws.checks)} check(s)")
        ex = self.executor.measure(base, scenarios, int(self.opts["pairs"]), [c.name for c in self.ws.checks],
                                   self.progress.event, result_metrics=metrics)
        base.feedback, base.checks = side_feedback(ex.candidate), dict(ex.checks)
        base.cost = Cost(wall_s=ex.wall_s, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs, tier=base.feedback.tier if base.feedback else None)
        base.finished_at = time.time()
        if ex.status != "done":
            base.status, base.error = "error", ex.error
            self.run.status, self.run.message = "error", f"the baseline could not be measured: {ex.error}"
            self._save(base)
            self.progress.line(self.run.message)
            return False
        gates = gates_of(self.ws, ex, base.id, None, relative=False)
        base.status = "done"
        base.verdict = Verdict(outcome="baseline", gates=gates, accepted=True, message="baseline measurement")
        self.run.gates_before = gates
        self._save(base)
        self.progress.finished(base, base, gates)
        return True

    def _stop_reason(self) -> str | None:
        table = self._table()
        if table and all(g.outcome in ("pass", "skipped") for g in table.values()) and not self.opts.get("keep_going"):
            return "every gate passes"
        left = self._runs_left()
        if left is not None and left <= 0:
            return "the experiment budget is spent"
        secs = self._seconds_left()
        if secs is not None and secs <= 0:
            return "the time budget is spent"
        return None

    def _iterate(self) -> None:
        # An experiment that was in flight when the run died is run again, as it was proposed.
        for exp in [e for e in self.history if e.role == "experiment" and not e.finished]:
            self._run_experiment(exp, None)
        while (reason := self._stop_reason()) is None:
            state = self._state()
            step = self.proposer.propose(state)
            if step is None:
                reason = getattr(self.proposer, "stopped_reason", None) or f"the {self.proposer.name} proposer has nothing more to try"
                break
            self._run_experiment(self._new_experiment(step, state.best), step)
        self.run.message = reason
        if reason.endswith("spent"):
            self.run.status = "budget"
        self.progress.line(f"stopped: {reason}")

    def _new_experiment(self, step: Step, best: Experiment) -> Experiment:
        exp = Experiment(id=f"e{self.ledger.next_seq(self.run.id)}", run_id=self.run.id, seq=self.ledger.next_seq(self.run.id),
                         parent=best.id, proposer=self.proposer.name, hypothesis=step.hypothesis, change=step.change,
                         cost=Cost(llm_tokens=step.llm_tokens))
        try:
            exp.knobs = dict(self.ws.resolve_knobs({**best.knobs, **step.change.knobs}))
        except InfraAgentError as exc:
            exp.status, exp.error = "rejected", f"the change's knobs are invalid: {exc}"
        exp.probe = None
        self._save(exp)
        return exp

    def _run_experiment(self, exp: Experiment, step: Step | None) -> None:
        best = self._by_id(exp.parent) or self._best()
        if exp.status == "rejected":
            self._finish(exp, best)
            return
        step = step or Step(hypothesis=exp.hypothesis, change=exp.change,
                            probe=exp.probe.name if exp.probe and exp.probe.reason == "named by the proposer" else None,
                            probe_config=exp.probe.config if exp.probe else {})
        changed = [c for k in exp.change.knobs if k in self.ws.knobs for c in self.ws.knobs[k].components]
        try:
            plan = self.planner.plan(step, changed)
        except InfraAgentError as exc:
            exp.status, exp.error = "error", f"planner: {exc}"
            self._finish(exp, best)
            return
        # A cheap gate that already fails on the parent says nothing about this change.
        table = self._table()
        plan.pre_checks = [c for c in plan.pre_checks if table.get(c) is None or table[c].outcome == "pass"]
        exp.probe, exp.status, exp.started_at = plan.probe, "running", time.time()
        self._save(exp)
        self.progress.experiment(exp, f"{plan.probe.name}/{plan.probe.tier.value}"
                                      + (f" after {len(plan.pre_checks)} cheap gate(s)" if plan.pre_checks else ""))
        ex = self.executor.execute(exp, plan, best, self.progress.event)
        exp.feedback = side_feedback(ex.candidate)
        exp.baseline_feedback = side_feedback(ex.baseline)
        exp.checks = dict(ex.checks)
        if plan.mode == "pair" and plan.check and ex.candidate.get(plan.check):
            exp.checks[plan.check] = ex.candidate[plan.check][-1]
        exp.cost = Cost(wall_s=ex.wall_s, tier=plan.probe.tier, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs,
                        llm_tokens=exp.cost.llm_tokens)
        if ex.status == "done":
            exp.verdict = judge(self.ws, exp, ex, plan, self._table())
            exp.status = "done"
        else:
            exp.status, exp.error = ex.status, ex.error
            if exp.feedback is None:
                kind = FindingKind.PROBE_TIMEOUT if ex.status == "timeout" else FindingKind.PROBE_ERROR
                exp.feedback = Feedback(probe=plan.probe.name, tier=plan.probe.tier, ok=False, error=ex.error,
                                        findings=[])
                exp.feedback.findings.append(failure_finding(kind, ex.error or ex.status))
        self._finish(exp, best, plan)

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

    def _confirm(self) -> None:
        best = self._best()
        base = self._by_id(self.run.baseline)
        assert base is not None
        table = self._table()
        if best.id == base.id or not self.opts.get("confirm", True):
            self.run.gates_after = list(table.values())
            return
        done = next((e for e in self.history if e.role == "confirm" and e.finished and e.parent == best.id), None)
        if done is None:
            done = run_confirm(self, base, best)
        self.run.gates_after = [g for g in (done.verdict.gates if done.verdict else []) if g.kind != "hypothesis"] \
            or list(table.values())


__all__ = ["Loop"]
