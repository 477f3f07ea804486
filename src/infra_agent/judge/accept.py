"""The accept rule: from an experiment's runs to its verdict, and the gate table it leaves.

An experiment is accepted when its hypothesis is supported and every gate that held on
its parent (a criterion, a check: a guard) still passes.  A guard that fails breaks it; a
guard left inconclusive holds it back as promising (one more round settles most).  A gate
that failed on the parent may still fail: progress on one criterion is not blocked by
another that was already red.  Each gate is evaluated once per experiment, on every run
of it pooled.  The
best configuration's gate table is the latest outcome of every gate, each labelled
with the experiment that measured it.

The judge compares the runs it is given: :class:`Runs` (what an executor measured) and
:class:`Design` (how the planner laid them out) are the parts of the agent's execution
and plan it reads.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from infra_agent.feedback import Feedback
from infra_agent.judge.gates import (
    check_gate,
    criteria_gates,
    holds_on_itself,
    hypothesis_outcome,
)
from infra_agent.judge.greedy_text import text_change
from infra_agent.judge.pooling import pool_runs
from infra_agent.judge.process_noise import ProcessNoise
from infra_agent.records import Experiment, GateResult, Verdict
from infra_agent.vocabulary import FindingKind


class Runs(Protocol):
    """What one execution measured (agent/executors/base.py ``Execution``)."""

    # scenario (ab) or check name (pair) -> one Feedback per run, index-paired across sides
    candidate: dict[str, list[Feedback]]
    baseline: dict[str, list[Feedback]]
    checks: dict[str, Feedback]  # cheap gates run on the candidate first


class Design(Protocol):
    """How the runs were laid out (agent/planner.py ``Plan``)."""

    mode: Literal["ab", "pair"]  # ab: interleaved serving runs; pair: the probe once per side
    check: str | None  # the workspace check the main probe comes from (mode pair)
    scenarios: list[str]


def check_runs(ex: Runs, plan: Design | None) -> dict[str, Feedback]:
    """Every check run on the candidate, one pooled Feedback per check: the cheap gates, and in a
    pair the check the experiment is about (all its rounds).  One gate per check comes from it."""
    runs: dict[str, list[Feedback]] = {name: [fb] for name, fb in ex.checks.items()}
    if plan is not None and plan.mode == "pair" and plan.check:
        runs.setdefault(plan.check, []).extend(ex.candidate.get(plan.check, []))
    pooled = {name: pool_runs(fbs) for name, fbs in runs.items()}
    return {name: fb for name, fb in pooled.items() if fb is not None}


def gates_of(workspace: Any, ex: Runs, exp_id: str, plan: Design | None, relative: bool = True,
             confidence: float = 0.95, noise: ProcessNoise | None = None) -> list[GateResult]:
    """Each criterion and each check evaluated once on the candidate, every run of it pooled.

    ``confidence``: of every interval; above 0.95 at a look of a sequential design.
    ``noise``: the spread between fresh server processes over the batches behind the pairs."""
    checks = check_runs(ex, plan)
    gates = criteria_gates(workspace, ex.candidate if (plan is None or plan.mode == "ab") else {},
                           ex.baseline if relative and (plan is None or plan.mode == "ab") else None, exp_id,
                           checks=checks, confidence=confidence, noise=noise)
    return gates + [check_gate(name, fb, exp_id, confidence) for name, fb in checks.items()]


def judge(workspace: Any, exp: Experiment, ex: Runs, plan: Design, best_gates: dict[str, GateResult],
          confidence: float = 0.95, noise: ProcessNoise | None = None) -> Verdict:
    """Accepted when the hypothesis is supported and every gate that held on the parent (a guard)
    still passes: a guard that fails breaks it; one left inconclusive (or unmeasurable) holds the
    candidate back as promising, never accepted silently."""
    key = plan.check if plan.mode == "pair" else (exp.hypothesis.scenario or (plan.scenarios[0] if plan.scenarios else ""))
    outcome, hyp_gate = hypothesis_outcome(exp.hypothesis, ex.candidate.get(key or "", []), ex.baseline.get(key or "", []),
                                           exp.id, confidence, noise)
    gates = gates_of(workspace, ex, exp.id, plan, confidence=confidence, noise=noise)
    guards = [g for g in gates if held_on_parent(workspace, g, best_gates)]
    broken = [g for g in guards if g.outcome == "fail"]
    undecided = [g for g in guards if g.outcome in ("inconclusive", "error")]
    lost = failed_requests(ex.candidate) - failed_requests(ex.baseline)
    miscut = wrong_lengths(ex.candidate) - wrong_lengths(ex.baseline)
    text = text_change(workspace, exp.change, ex.candidate, ex.baseline)
    retold = text is not None and bool(text.changed)
    # Latencies and throughput count only what was served, and served as asked: the same
    # number of tokens, and (where the change claims to keep the numbers) the same text.
    served = lost <= 0 and miscut <= 0 and not retold
    accepted = outcome == "supported" and not broken and not undecided and served
    # What was served comes first: a side that served less has numbers for other work, whatever
    # they say, and a "more pairs" reading of an inconclusive verdict would only measure it again.
    if lost > 0:
        # Latency and throughput count only requests that succeeded: a change that makes
        # requests fail (a queue cap, a crash under load) can look faster while serving less.
        why = (f"not accepted: {lost} more request(s) failed than on the baseline side; latencies of failed "
               "requests are not in the metrics, so the numbers would flatter the change")
    elif miscut > 0:
        # A server that answers fewer tokens than asked (or ignores max_tokens) is faster at
        # a different job: the speed is not the system's.
        why = (f"not accepted: {miscut} more answer(s) than on the baseline side were not the length the request "
               "fixed (max_tokens with ignore_eos); the candidate's numbers are for less (or other) work")
    elif retold:
        assert text is not None
        # A faster server that answers other text (other weights, skipped layers, a cheaper
        # model) is faster at a different job, whatever the numbers say.
        why = (f"not accepted: {text.text()}; the change claims to keep the model's numbers (a knob meant to "
               "change them is declared changes_outputs: true)")
    elif outcome != "supported":
        why = f"not accepted: the hypothesis is {outcome} ({hyp_gate.message})"
    elif broken:
        why = "not accepted: it breaks " + ", ".join(f"{g.name} ({g.message})" for g in broken)
    elif undecided:
        why = ("not accepted (promising, a guard undecided): the hypothesis is supported but "
               + ", ".join(f"{g.name} is {g.outcome} ({g.message})" for g in undecided))
    else:
        why = f"accepted: {hyp_gate.message}"
    return Verdict(outcome=outcome, effect=hyp_gate.value, low=hyp_gate.low, high=hyp_gate.high,
                   interval=hyp_gate.interval, gates=[hyp_gate, *gates], accepted=accepted,
                   held=outcome == "supported" and not broken and bool(undecided) and served, served=served,
                   message=why)


def undecided_guards(workspace: Any, verdict: Verdict, best_gates: dict[str, GateResult]) -> list[GateResult]:
    """The guards a supported hypothesis left undecided: what one more round should settle."""
    if verdict.outcome != "supported":
        return []
    return [g for g in verdict.gates if g.kind != "hypothesis" and g.outcome == "inconclusive"
            and held_on_parent(workspace, g, best_gates)]


def _evidence_total(side: dict[str, list[Feedback]], kind: str, *keys: str) -> int:
    """The sum of ``keys`` in the evidence of every ``kind`` finding over a side's runs."""
    return sum(int(f.evidence.get(key, 0) or 0) for runs in side.values() for fb in runs for f in fb.findings
               if f.kind == kind for key in keys)


def failed_requests(side: dict[str, list[Feedback]]) -> int:
    """Failed requests over a side's serving windows (from the probes' ``failed_requests`` findings)."""
    return _evidence_total(side, FindingKind.FAILED_REQUESTS, "failed")


def wrong_lengths(side: dict[str, list[Feedback]]) -> int:
    """Answers of the wrong length over a side's serving windows (the ``wrong_answer_length`` findings)."""
    return _evidence_total(side, FindingKind.WRONG_ANSWER_LENGTH, "short", "long")


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


__all__ = ["Design", "Runs", "check_runs", "failed_requests", "gates_of", "held_on_parent", "judge", "undecided_guards",
           "update_table", "wrong_lengths"]
