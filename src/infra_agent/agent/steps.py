"""One proposed step, through to a recorded experiment: screen, plan, execute, judge, record.

- A step the screen refuses (agent/screening.py) is recorded as ``rejected`` and costs no run.
- A candidate whose server refuses its configuration at start-up is refuted (agent/refused.py).
- Otherwise the planner picks the probe and the cheap gates, the sample-size plan is said, the
  executor runs the first batch and the judge looks after each batch (agent/rounds.py).
- The same change on the same parent as an open experiment (inconclusive, promising) is not a
  new experiment: that one gets one more batch, since inconclusive is not refuted.

Every state change goes through :meth:`Loop.record` (the ledger first), and every experiment
ends in :meth:`Loop.finish`, so ``resume`` re-runs an unfinished one from the start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.judging import failure_finding
from infra_agent.agent.planner import NAMED, Plan, is_timed_pair
from infra_agent.agent.refused import record_refusal
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
from infra_agent.records import Cost, Experiment, ProbeCall, Step
from infra_agent.vocabulary import FindingKind

if TYPE_CHECKING:
    from infra_agent.agent.loop import Loop


def take_step(loop: Loop, step: Step, best: Experiment) -> Experiment:
    """A new experiment; or, for the same change on the same parent as an open one
    (inconclusive, promising), one more batch of that experiment: inconclusive is not refuted."""
    again = open_match(loop.ws, loop.history, best, step)
    if again is not None and one_more_batch(loop, again):
        return again
    exp = new_experiment(loop, step, best)
    run_experiment(loop, exp, step)
    return exp


def one_more_batch(loop: Loop, exp: Experiment) -> bool:
    """One more batch of the open experiment ``exp``, judged and recorded; False when it could not run."""
    best = loop.find(exp.parent) or loop.best()
    # The probe it named (a search step's check) again, as run_experiment rebuilds it.
    named = exp.probe is not None and exp.probe.reason == NAMED
    step = Step(hypothesis=exp.hypothesis, change=exp.change,
                probe=(exp.probe.check or exp.probe.name) if exp.probe and named else None,
                probe_config=exp.probe.config if exp.probe and named else {})
    try:
        plan = loop.planner.plan(step, changed_components(loop, exp))
    except InfraAgentError:
        return False
    plan.pre_checks = []  # they ran, and passed, in its first batches
    ran = reopen(loop.ws, loop.executor, exp, plan, best, loop.gate_table(decisive=True),
                 take=lambda ex: take(exp, ex, plan), say=loop.progress.line, on_event=loop.progress.event,
                 noise=loop.noise)
    loop.finish(exp, best)
    return ran


def reopen_best_open(loop: Loop, best: Experiment) -> bool:
    """The most promising open experiment on ``best`` gets one more batch (once per run)."""
    left = loop.runs_left()
    if not loop.opts.get("top_up", True) or (left is not None and left < 1):
        return False  # --no-top-up: every experiment is judged on its first batch
    exp = most_promising_open(loop.history, best)
    return exp is not None and one_more_batch(loop, exp)


def changed_components(loop: Loop, exp: Experiment) -> list[str]:
    """The components the experiment's knobs affect (for the planner's cheap gates)."""
    return [c for k in exp.change.knobs if k in loop.ws.knobs for c in loop.ws.knobs[k].components]


def new_experiment(loop: Loop, step: Step, best: Experiment) -> Experiment:
    """``step`` as an experiment on ``best``, screened and recorded (``rejected`` with the reason
    when it must not run)."""
    seq = loop.ledger.next_seq(loop.run.id)
    exp = Experiment(id=f"e{seq}", run_id=loop.run.id, seq=seq, parent=best.id, proposer=loop.proposer.name,
                     hypothesis=step.hypothesis, change=step.change, cost=Cost(llm_tokens=step.llm_tokens),
                     base_commit=best.commit or best.base_commit)
    exp.knobs, why = screen(loop.ws, step, best, loop.history)
    if why is not None:
        exp.status, exp.error = "rejected", why
    elif step.probe is not None:
        # Kept from the proposal, so a run killed before the start re-runs the probe it named.
        exp.probe = ProbeCall(name=step.probe, config=step.probe_config, reason=NAMED,
                              tier=Tier.e2e if step.probe == "serving" else Tier.check)
    loop.record(exp)
    return exp


def run_experiment(loop: Loop, exp: Experiment, step: Step | None) -> None:
    """Plan, execute and judge ``exp`` (``step``: None when resuming, rebuilt from the record)."""
    best = loop.find(exp.parent) or loop.best()
    if exp.status == "rejected":
        loop.finish(exp, best)
        return
    exp.verdict = exp.error = exp.commit = None  # run again from the start (resume)
    named = exp.probe is not None and exp.probe.reason == NAMED
    step = step or Step(hypothesis=exp.hypothesis, change=exp.change,
                        probe=(exp.probe.check or exp.probe.name) if exp.probe and named else None,
                        probe_config=exp.probe.config if exp.probe and named else {})
    try:
        plan = loop.planner.plan(step, changed_components(loop, exp))
    except InfraAgentError as exc:
        exp.probe, exp.status, exp.error = None, "error", f"planner: {exc}"
        loop.finish(exp, best)
        return
    # A cheap gate that already fails on the parent says nothing about this change.
    table = loop.gate_table()
    plan.pre_checks = [c for c in plan.pre_checks if table.get(c) is None or table[c].outcome == "pass"]
    _execute_and_judge(loop, exp, plan, best)
    loop.finish(exp, best)


def _execute_and_judge(loop: Loop, exp: Experiment, plan: Plan, best: Experiment) -> None:
    # The sample-size plan is said before the runs are spent (agent/rounds.py).
    sp = sample_plan(exp, plan, loop.history, loop.opts, loop.noise)
    exp.sample_plan = sp.as_dict()
    exp.probe, exp.status, exp.started_at = plan.probe, "running", time.time()
    loop.record(exp)
    loop.progress.experiment(exp, f"{plan.probe.name}/{plan.probe.tier.value}"
                                  + (f" after {len(plan.pre_checks)} cheap gate(s)" if plan.pre_checks else ""))
    if plan.mode == "ab" or is_timed_pair(plan):
        loop.progress.line(f"{exp.id} {sp.text()}")
    ex = loop.executor.execute(exp, plan, best, loop.progress.event)
    take(exp, ex, plan)
    if ex.status == "done":
        judge_in_rounds(loop.ws, loop.executor, exp, plan, best, ex, loop.gate_table(decisive=True), sp,
                        take=lambda: take(exp, ex, plan), say=lambda text: loop.progress.experiment(exp, text),
                        on_event=loop.progress.event, noise=loop.noise)
        exp.status = "done"
    elif ex.refusal is not None:
        # The server refused the configuration: refuted, not failed (agent/refused.py).
        record_refusal(exp, ex.refusal, plan, (loop.baseline() or best).knobs)
    else:
        exp.status, exp.error = ex.status, ex.error
        if exp.feedback is None:
            kind = FindingKind.PROBE_TIMEOUT if ex.status == "timeout" else FindingKind.PROBE_ERROR
            exp.feedback = Feedback(probe=plan.probe.name, tier=plan.probe.tier, ok=False, error=ex.error,
                                    findings=[])
            exp.feedback.findings.append(failure_finding(kind, ex.error or ex.status))


def take(exp: Experiment, ex: Execution, plan: Plan) -> None:
    """What the execution measured, onto the experiment: both sides' Feedback, the checks (every
    run of each pooled), the cost."""
    exp.feedback = side_feedback(ex.candidate)
    exp.baseline_feedback = side_feedback(ex.baseline)
    exp.checks = check_runs(ex, plan)
    exp.cost = Cost(wall_s=ex.wall_s, tier=plan.probe.tier, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs,
                    launches=ex.launches, llm_tokens=exp.cost.llm_tokens)


__all__ = ["NAMED", "changed_components", "new_experiment", "one_more_batch", "reopen_best_open", "run_experiment",
           "take", "take_step"]
