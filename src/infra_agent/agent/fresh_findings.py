"""Fresh findings: when the proposer has nothing to try while a gate still fails, re-run its check.

The run option and the CLI flag call this a *look-again* (``look_again``, ``--no-look-again``).

A trace-tier check samples a few seconds of the target.  The finding that names the
next fix (the engine waiting on the transfer thread's per-page Python, say) is in most
samples of that window but not in every one, and a proposer that reads findings has
nothing to go on when it is missing.  An engineer would measure again before giving
up; so does the loop, once per best configuration: the checks behind the failing gates
(or every check, when the failing gates are not checks) run anew on the best's code,
and the proposer is asked again with their findings.

What a look-again is, and is not:
- an experiment of role ``diagnose`` with no change, whose question is "where does the
  remaining gap come from?"; it counts against ``--budget-runs`` like an experiment,
  since it costs a check run;
- its checks join the best configuration's feedback (``Loop.state``), newest last;
- it leaves the gate table alone: a re-measure that passes by noise is not a fix, and
  a gate changes only through an experiment's verdict or the confirmation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infra_agent.feedback import Tier
from infra_agent.records import Cost, Experiment, GateResult, Hypothesis, Verdict

if TYPE_CHECKING:
    from infra_agent.agent.loop import Loop
    from infra_agent.workspace.models import Workspace


def checks_to_rerun(ws: Workspace, table: dict[str, GateResult]) -> list[str]:
    """The checks behind the failing gates; every check when the failing gates are criteria."""
    names = [c.name for c in ws.checks]
    failing = [g for g in table.values() if g.outcome == "fail"]
    if not failing:
        return []
    behind = [g.name for g in failing if g.kind == "check" and g.name in names]
    return behind or names


def looked_at(history: list[Experiment], best: Experiment) -> Experiment | None:
    """The look-again already run (or left unfinished by a killed run) on ``best``."""
    return next((e for e in history if e.role == "diagnose" and e.parent == best.id), None)


def look_again(loop: Loop, best: Experiment, why: str) -> bool:
    """Re-run the failing gates' checks on ``best`` once, for fresh findings; False when it
    was done already, would spend the budget's last run, has nothing to re-run, or is
    switched off (``--no-look-again``)."""
    if not loop.opts.get("look_again", True):
        return False
    left = loop.runs_left()
    if left is not None and left < 2:
        return False  # a look-again that leaves no run for the step it may lead to is wasted
    done = looked_at(loop.history, best)
    if done is not None and done.finished:
        return False
    checks = checks_to_rerun(loop.ws, loop.gate_table())
    if not checks:
        return False
    return run_look_again(loop, best, checks, why).status == "done"


def run_look_again(loop: Loop, best: Experiment, checks: list[str], why: str) -> Experiment:
    """Re-run ``checks`` on ``best`` with fresh samples; the experiment records their feedback."""
    again = looked_at(loop.history, best)
    seq = again.seq if again is not None else loop.ledger.next_seq(loop.run.id)
    gates = ", ".join(sorted(g.name for g in loop.gate_table().values() if g.outcome == "fail"))
    hyp = Hypothesis(statement=f"look again: {why}, while {gates} fail(s); a fresh run of {', '.join(checks)} "
                               f"on {best.id} may carry the finding that names the next change",
                     metric="-", direction="higher")
    exp = Experiment(id=again.id if again is not None else f"e{seq}", run_id=loop.run.id, seq=seq, parent=best.id,
                     role="diagnose", proposer=loop.proposer.name, hypothesis=hyp, knobs=dict(best.knobs),
                     commit=best.commit, base_commit=best.commit or best.base_commit)
    exp.status, exp.started_at = "running", time.time()
    loop.record(exp)
    loop.progress.experiment(exp, f"{', '.join(checks)}/check again on {best.id}")
    # Fresh: the executor's cache holds the very runs whose findings named nothing.
    with loop.executor.fresh_checks():
        ex = loop.executor.measure(exp, [], 0, checks, loop.progress.event)
    exp.checks = dict(ex.checks)
    exp.cost = Cost(wall_s=ex.wall_s, tier=Tier.check, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs,
                    launches=ex.launches)
    exp.finished_at = time.time()
    if ex.status != "done" and not exp.checks:
        exp.status, exp.error = ex.status, ex.error or ex.status
    else:
        exp.status = "done"
        found = [f for fb in exp.checks.values() for f in fb.findings]
        named = sorted({f"{f.kind}" + (f" at {f.location.component}" if f.location and f.location.component else "")
                        for f in found})
        exp.verdict = Verdict(outcome="diagnosed", message=f"{len(found)} finding(s) on a fresh run"
                              + (f": {'; '.join(named[:6])}" if named else ""))
    loop.record(exp)
    loop.progress.finished(exp, best, list(loop.gate_table().values()))
    return exp


__all__ = ["checks_to_rerun", "look_again", "looked_at", "run_look_again"]
