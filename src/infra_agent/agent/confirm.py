"""The confirmation: the best configuration against the baseline, side by side.

Each accepted experiment was judged against its parent.  The gate table *after* comes
from one more interleaved A/B, best against baseline, so relative criteria are relative
to where the run started and every gate is measured on the final configuration.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.extra_batch import run_extra_batch
from infra_agent.agent.planner import Plan
from infra_agent.agent.rounds import by_scenario
from infra_agent.judge.accept import gates_of
from infra_agent.judge.gates import hypothesis_outcome
from infra_agent.judge.pooling import pool_runs, side_feedback
from infra_agent.judge.process_noise import ProcessNoise
from infra_agent.judge.sequential import SequentialDesign
from infra_agent.records import (
    Cost,
    Experiment,
    GateResult,
    Hypothesis,
    Step,
    Verdict,
)

if TYPE_CHECKING:
    from infra_agent.agent.loop import Loop


def confirm_best(loop: Loop) -> Experiment | None:
    """The run's *after* table: the confirmation of the best against the baseline (once per
    best; one a killed run left unfinished runs again under its id), or the gate table as
    it stands when nothing was accepted or ``--no-confirm``.  Returns the confirmation.

    A run resumed after its confirmation did not confirm (``top_up_confirmation``, set by
    ``resume``) tops that confirmation up: one more round of pairs pooled with its own, and
    the checks again, without measuring anything else anew."""
    best = loop.best()
    base = loop.baseline()
    assert base is not None
    table = loop.gate_table()
    if best.id == base.id or not loop.opts.get("confirm", True):
        loop.run.gates_after = list(table.values())
        return None
    done = next((e for e in loop.history if e.role == "confirm" and e.finished and e.parent == best.id), None)
    if done is None:
        again = next((e for e in loop.history if e.role == "confirm" and not e.finished and e.parent == best.id), None)
        done = run_confirm(loop, base, best, again)
    elif loop.opts.pop("top_up_confirmation", False) and done.verdict is not None \
            and done.verdict.outcome == "not_confirmed":
        done = top_up_confirmation(loop, base, best, done)
    loop.run.gates_after = [g for g in (done.verdict.gates if done.verdict else []) if g.kind != "hypothesis"] \
        or list(table.values())
    return done


def run_confirm(loop: Loop, base: Experiment, best: Experiment, again: Experiment | None = None) -> Experiment:
    """Run the confirmation (``again``: one a killed run left unfinished, run again under its id)."""
    from infra_agent.workspace import metric_direction

    scenarios = loop.opts.get("scenarios") or sorted({c.scenario for c in loop.ws.criteria if c.scenario} or loop.ws.scenarios)
    # The headline criterion: the first one measured in the scenarios this run uses (not one judged on a check).
    crit = next((c for c in loop.ws.criteria if getattr(c, "check", None) is None
                 and (c.scenario is None or c.scenario in scenarios)), None)
    metric = crit.metric if crit else "output_throughput"
    hyp = Hypothesis(statement="the accepted changes together hold every gate against the baseline", metric=metric,
                     direction=metric_direction(metric) or "higher",
                     scenario=(crit.scenario if crit else None) or (scenarios[0] if scenarios else None))
    seq = again.seq if again is not None else loop.ledger.next_seq(loop.run.id)
    exp = Experiment(id=again.id if again is not None else f"e{seq}", run_id=loop.run.id, seq=seq,
                     parent=best.id, role="confirm", proposer="-", hypothesis=hyp, knobs=dict(best.knobs),
                     commit=best.commit)
    plan = _plan(loop, hyp, scenarios)
    exp.probe, exp.status, exp.started_at = plan.probe, "running", time.time()
    loop.record(exp)
    loop.progress.experiment(exp, "serving/e2e: best vs baseline")
    ex = loop.executor.execute(exp, plan, base, loop.progress.event)
    # Every check, on the best's code (the executor measures a commit in a worktree of its own).
    unmeasured: list[GateResult] = []
    for check in loop.ws.checks:
        if check.name not in ex.checks:
            got = loop.executor.measure(exp, [], 0, [check.name], loop.progress.event)
            ex.checks.update(got.checks)
            ex.wall_s, ex.probe_runs = ex.wall_s + got.wall_s, ex.probe_runs + got.probe_runs
            if check.name not in got.checks:
                unmeasured.append(GateResult(name=check.name, gate=f"check {check.name} ({check.probe})", kind="check",
                                             outcome="error", measured_in=exp.id,
                                             message=f"the check could not run ({got.status}): {got.error}"))
    exp.feedback, exp.baseline_feedback, exp.checks = side_feedback(ex.candidate), side_feedback(ex.baseline), dict(ex.checks)
    exp.cost = Cost(wall_s=ex.wall_s, tier=plan.probe.tier, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs,
                    launches=ex.launches)
    conf = _confidence(loop.opts)
    exp.sample_plan = {"batches": 1}
    gates = gates_of(loop.ws, ex, exp.id, plan, confidence=conf, noise=_noise(loop, exp)) + unmeasured
    if ex.status == "done" and _undecided(gates) and loop.opts.get("top_up", True):
        gates = _top_up(loop, exp, plan, base, ex, gates, unmeasured, confidence=conf)
    _decide(loop, exp, best, plan, ex, gates, conf)
    return exp


def _batches(exp: Experiment) -> int:
    """Batches of pairs behind the confirmation's windows (each on fresh servers)."""
    return int((exp.sample_plan or {}).get("batches") or 1)


def _noise(loop: Loop, exp: Experiment) -> ProcessNoise | None:
    """The spread between fresh server processes over the confirmation's batches (judge/process_noise.py)."""
    noise = getattr(loop, "noise", None)
    return noise.after(_batches(exp)) if noise is not None else None


def _plan(loop: Loop, hyp: Hypothesis, scenarios: list[str]) -> Plan:
    plan = Plan(probe=loop.planner.plan(Step(hypothesis=hyp, probe="serving"), []).probe, mode="ab", scenarios=scenarios,
                result_metrics=sorted({c.metric for c in loop.ws.criteria}))
    plan.probe.reason = "confirmation: the best against the baseline, side by side"
    return plan


def _confidence(opts: dict[str, Any], looks: int | None = None) -> float:
    """The confirmation's interval: two looks (the first round and one more) at Pocock's level,
    or one look at 95% with ``--no-top-up`` (judge/sequential.py)."""
    n = looks if looks is not None else (2 if opts.get("top_up", True) else 1)
    return SequentialDesign(looks=n, batch=int(opts.get("pairs") or 3)).confidence


def _decide(loop: Loop, exp: Experiment, best: Experiment, plan: Plan, ex: Execution, gates: list[GateResult],
            confidence: float) -> None:
    """The confirmation's verdict from its gate table; the experiment is saved and reported."""
    hyp = exp.hypothesis
    _, hyp_gate = hypothesis_outcome(hyp, ex.candidate.get(hyp.scenario or "", []), ex.baseline.get(hyp.scenario or "", []),
                                     exp.id, confidence, _noise(loop, exp))
    ok = ex.status == "done" and all(g.outcome in ("pass", "skipped") for g in gates)
    exp.status, exp.error = ("done", None) if ex.status == "done" else (ex.status, ex.error)
    exp.verdict = Verdict(outcome="confirmed" if ok else "not_confirmed", gates=[hyp_gate, *gates],
                          message="every gate holds against the baseline" if ok else "not every gate holds against the baseline")
    loop.executor.finalize(exp, False, "")
    exp.finished_at = time.time()
    loop.record(exp)
    loop.progress.finished(exp, best, gates)


def top_up_confirmation(loop: Loop, base: Experiment, best: Experiment, done: Experiment) -> Experiment:
    """One more round for a confirmation that did not confirm (``resume``): its recorded windows
    and checks pooled with a new round of pairs and fresh runs of the checks."""
    scenarios = sorted({s for fb in (done.feedback, done.baseline_feedback) if fb is not None
                        for m in fb.measurements if (s := m.tags.get("scenario"))})
    ex = Execution(status="done", candidate=by_scenario(done.feedback, scenarios),
                   baseline=by_scenario(done.baseline_feedback, scenarios),
                   checks=dict(done.checks), wall_s=done.cost.wall_s, e2e_runs=done.cost.e2e_runs,
                   probe_runs=done.cost.probe_runs, launches=done.cost.launches)
    plan = _plan(loop, done.hypothesis, scenarios)
    done.status, done.started_at = "running", time.time()
    loop.record(done)
    gates = [g for g in (done.verdict.gates if done.verdict else []) if g.kind != "hypothesis"]
    # A third look at evidence planned for two: the interval is the three-look design's.
    conf = _confidence(loop.opts, looks=3)
    gates = _top_up(loop, done, plan, base, ex, gates, [], why="resumed after it did not confirm", confidence=conf)
    _decide(loop, done, best, plan, ex, gates, conf)
    return done


def _undecided(gates: list[GateResult]) -> list[str]:
    """Gates one more round could decide: criteria, and checks decided on a statistic's interval."""
    return [g.name for g in gates if g.kind in ("absolute", "relative", "check") and g.outcome == "inconclusive"]


def _top_up(loop: Loop, exp: Experiment, plan: Plan, base: Experiment, ex: Execution, gates: list[GateResult],
            unmeasured: list[GateResult], why: str = "", confidence: float = 0.95) -> list[GateResult]:
    """One more round of as many interleaved pairs when a gate is left undecided (``top_up``),
    and the checks again: the confirmation is the gate table the user reads, so it asks for
    the samples before reporting.  Every run pools with the first round's.  A failed top-up
    keeps the first table."""
    undecided = _undecided(gates) or [g.name for g in gates if g.outcome != "pass"]
    loop.progress.experiment(exp, f"serving/e2e: more pairs, {why or ', '.join(undecided) + ' undecided'}")
    done = run_extra_batch(loop.executor, exp, plan, base, ex, loop.progress.event)
    for check in [c.name for c in loop.ws.checks if c.name in undecided]:
        with loop.executor.fresh_checks():
            got = loop.executor.measure(exp, [], 0, [check], loop.progress.event)
        ex.wall_s, ex.probe_runs = ex.wall_s + got.wall_s, ex.probe_runs + got.probe_runs
        if check in got.checks:
            pooled = pool_runs([ex.checks[check], got.checks[check]]) if check in ex.checks else got.checks[check]
            ex.checks[check] = pooled or got.checks[check]
    exp.cost = Cost(wall_s=ex.wall_s, tier=plan.probe.tier, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs,
                    launches=ex.launches)
    if not done:
        return gates
    exp.feedback, exp.baseline_feedback, exp.checks = side_feedback(ex.candidate), side_feedback(ex.baseline), dict(ex.checks)
    exp.sample_plan = {**(exp.sample_plan or {}), "batches": _batches(exp) + 1}
    return gates_of(loop.ws, ex, exp.id, plan, confidence=confidence, noise=_noise(loop, exp)) + unmeasured
