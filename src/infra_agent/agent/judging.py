"""From an execution to a verdict: the hypothesis, the gates, and whether to accept.

An experiment is accepted when its hypothesis is supported and it breaks no gate that
held on its parent (a criterion, a check).  A gate that failed on the parent may still
fail: progress on one criterion is not blocked by another that was already red.  The
best configuration's gate table is the latest outcome of every gate, each labelled
with the experiment that measured it.
"""

from __future__ import annotations

from typing import Any

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.experiment import Experiment, GateResult, Verdict
from infra_agent.agent.planner import Plan
from infra_agent.feedback import Feedback, Measurement
from infra_agent.judge.gates import (
    check_gate,
    criteria_gates,
    holds_on_itself,
    hypothesis_outcome,
)


def merge_feedback(feedbacks: list[Feedback]) -> Feedback | None:
    """Runs of one probe as one Feedback: samples pooled per (name, tags), findings de-duplicated."""
    if not feedbacks:
        return None
    first = feedbacks[0]
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], Measurement] = {}
    for fb in feedbacks:
        for m in fb.measurements:
            key = (m.name, tuple(sorted(m.tags.items())))
            if key in merged:
                old = merged[key]
                merged[key] = Measurement.from_samples(m.name, m.unit, old.samples + m.samples, old.better, **old.tags)
            else:
                merged[key] = m
    seen: set[tuple[str, str]] = set()
    findings = []
    for fb in reversed(feedbacks):  # the latest run's wording of a recurring finding
        for f in fb.findings:
            fkey = (f.kind, str(f.location))
            if fkey not in seen:
                seen.add(fkey)
                findings.append(f)
    return Feedback(probe=first.probe, tier=first.tier, scope=first.scope, ok=all(fb.ok for fb in feedbacks),
                    error=next((fb.error for fb in feedbacks if fb.error), None), measurements=list(merged.values()),
                    findings=findings, artifacts=[a for fb in feedbacks for a in fb.artifacts],
                    meta={**first.meta, "runs": len(feedbacks)})


def side_feedback(side: dict[str, list[Feedback]]) -> Feedback | None:
    """All runs of one side (every scenario, or the one check) as one Feedback."""
    return merge_feedback([fb for runs in side.values() for fb in runs])


def gates_of(workspace: Any, ex: Execution, exp_id: str, plan: Plan | None, relative: bool = True) -> list[GateResult]:
    # The checks run on the candidate, for criteria that name one (the main probe's too, in a pair).
    checks = dict(ex.checks)
    if plan is not None and plan.mode == "pair" and plan.check and ex.candidate.get(plan.check):
        checks[plan.check] = ex.candidate[plan.check][-1]
    gates = criteria_gates(workspace, ex.candidate if (plan is None or plan.mode == "ab") else {},
                           ex.baseline if relative and (plan is None or plan.mode == "ab") else None, exp_id,
                           checks=checks)
    for name, fb in ex.checks.items():
        gates.append(check_gate(name, fb, exp_id))
    if plan is not None and plan.mode == "pair" and plan.check:
        gates += [check_gate(plan.check, fb, exp_id) for fb in ex.candidate.get(plan.check, [])]
    return gates


def judge(workspace: Any, exp: Experiment, ex: Execution, plan: Plan, best_gates: dict[str, GateResult]) -> Verdict:
    key = plan.check if plan.mode == "pair" else (exp.hypothesis.scenario or (plan.scenarios[0] if plan.scenarios else ""))
    outcome, hyp_gate = hypothesis_outcome(exp.hypothesis, ex.candidate.get(key or "", []), ex.baseline.get(key or "", []),
                                           exp.id)
    gates = gates_of(workspace, ex, exp.id, plan)
    broken = [g for g in gates if g.outcome == "fail" and held_on_parent(workspace, g, best_gates)]
    lost = failed_requests(ex.candidate) - failed_requests(ex.baseline)
    accepted = outcome == "supported" and not broken and lost <= 0
    if outcome != "supported":
        why = f"not accepted: the hypothesis is {outcome} ({hyp_gate.message})"
    elif lost > 0:
        # Latency and throughput count only requests that succeeded: a change that makes
        # requests fail (a queue cap, a crash under load) can look faster while serving less.
        why = (f"not accepted: {lost} more request(s) failed than on the baseline side; latencies of failed "
               "requests are not in the metrics, so the numbers would flatter the change")
    elif broken:
        why = "not accepted: it breaks " + ", ".join(f"{g.name} ({g.message})" for g in broken)
    else:
        why = f"accepted: {hyp_gate.message}"
    return Verdict(outcome=outcome, effect=hyp_gate.value, low=hyp_gate.low, high=hyp_gate.high,
                   interval=hyp_gate.interval, gates=[hyp_gate, *gates], accepted=accepted, message=why)


def failed_requests(side: dict[str, list[Feedback]]) -> int:
    """Failed requests over a side's serving windows (from the probes' ``failed_requests`` findings)."""
    from infra_agent.vocabulary import FindingKind

    return sum(int(f.evidence.get("failed", 0) or 0) for runs in side.values() for fb in runs for f in fb.findings
               if f.kind == FindingKind.FAILED_REQUESTS)


def held_on_parent(workspace: Any, gate: GateResult, parent: dict[str, GateResult]) -> bool:
    """Whether ``gate`` held on the parent, so failing it now breaks it.

    A relative criterion is measured against the parent itself, where the ratio is 1:
    a guard (``>= 0.95``) always held there, a target (``>= 1.2``) never did.  Any other
    gate held when its last decisive outcome on the accepted path (``parent``, built
    with ``update_table(..., decisive=True)``) was a pass: a gate that an accepted
    change left inconclusive is still guarded, so two steps cannot break what one may not."""
    if gate.kind == "relative":
        crit = next((c for c in getattr(workspace, "criteria", []) if c.name == gate.name), None)
        return crit is not None and crit.ratio is not None and holds_on_itself(crit.op or ">=", float(crit.ratio))
    prev = parent.get(gate.name)
    return prev is not None and prev.outcome in ("pass", "skipped")


def update_table(table: dict[str, GateResult], gates: list[GateResult], decisive: bool = False) -> dict[str, GateResult]:
    """The gate table after ``gates``: each gate's latest outcome (a ``skipped`` one only fills a gap).

    ``decisive``: keep the latest pass or fail instead, for the accept rule."""
    out = dict(table)
    for g in gates:
        if g.kind == "hypothesis":
            continue
        if g.name not in out or (g.outcome in ("pass", "fail") if decisive else g.outcome != "skipped"):
            out[g.name] = g
    return out


def failure_finding(kind: str, message: str) -> Any:
    from infra_agent.feedback import Finding

    return Finding(kind=kind, severity="error", message=message.splitlines()[0][:300] if message else kind,
                   evidence={"detail": message[-2000:]} if message else {})


def commit_message(exp: Experiment) -> str:
    v = exp.verdict
    h = exp.hypothesis
    lines = [f"infra-agent {exp.id}: {h.statement}"[:200], "",
             f"Hypothesis: {h.metric} {'rises' if h.direction == 'higher' else 'falls'} by >= {h.min_effect:g}"
             + (f" in scenario {h.scenario}" if h.scenario else ""),
             f"Verdict: {v.outcome if v else exp.status}" + (f", effect {v.effect:.4g} [{v.low:.4g}, {v.high:.4g}] ({v.interval})"
                                                              if v and v.effect is not None and v.low is not None and v.high is not None else ""),
             f"Run: {exp.run_id}, parent {exp.parent}"]
    if v:
        lines += [f"Gate {g.name}: {g.outcome}" for g in v.gates if g.kind != "hypothesis"]
    return "\n".join(lines)
