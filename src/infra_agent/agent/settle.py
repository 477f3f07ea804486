"""A best whose gate lacks samples, not a change: one more batch of it before anything new.

After the right change a gate can be left inconclusive with its estimate already on the
passing side: case B's check read 0.959 [0.927, 0.992] against ``>= 0.95`` on a busy host,
the Layer Split check 0.7-0.8 against ``>= 0.7`` with an interval across the bar.  The
run then proposed other changes on that best, each judged against it, and ended on its
budget with the gate still undecided, where more samples of the configuration it had were
what the gate needed.  So, once per best: an accepted knob change whose gate is left
inconclusive past its threshold is reopened (``rounds.reopen``): one more batch of the same
interleaved A/B against its parent, pooled with its own and judged at a design with one
look more, so the extra look is paid for in the interval.  The gate then changes through
that experiment's verdict, as every gate does; a pass by one lucky batch alone is not
possible, since the pooled runs decide.

Not for a code change (its worktree is committed and gone) or a best with experiments on
it already (they were judged against it); no run of ``--budget-runs`` is spent, as for any
other reopened experiment, and ``--no-top-up`` switches it off.  More samples may also undo
the acceptance (the hypothesis's interval widened across its line): the best is then its
parent again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infra_agent.agent.steps import one_more_batch
from infra_agent.records import Experiment, GateResult

if TYPE_CHECKING:
    from infra_agent.agent.loop import Loop


def lacks_samples(g: GateResult) -> bool:
    """Inconclusive with its estimate on the passing side of its threshold."""
    spec = g.spec
    if g.kind == "hypothesis" or g.outcome != "inconclusive" or spec is None or g.value is None:
        return False
    return g.value >= spec.threshold if spec.higher else g.value <= spec.threshold


def settle_best(loop: Loop, best: Experiment) -> bool:
    """One more batch of ``best`` when a gate of it lacks samples (once per best); True when it ran."""
    left = loop.runs_left()
    if not loop.opts.get("top_up", True) or (left is not None and left < 1):
        return False
    v = best.verdict
    if best.role != "experiment" or v is None or not v.accepted or (best.change.diff or "").strip():
        return False
    if (best.sample_plan or {}).get("settled") or any(e.parent == best.id for e in loop.history):
        return False
    short = [g for g in v.gates if lacks_samples(g)]
    if not short:
        return False
    best.sample_plan = {**(best.sample_plan or {}), "settled": True}
    loop.record(best)
    loop.progress.line(f"{best.id}: {', '.join(f'{g.name} ({g.value:.3g} [{g.low:.3g}, {g.high:.3g}])' for g in short)} "
                       f"left inconclusive past the threshold: more samples of {best.id}, not another change")
    ran = one_more_batch(loop, best)
    if not (best.verdict is not None and best.verdict.accepted) and loop.run.best == best.id:
        loop.run.best = best.parent
        loop.record_run()
        loop.progress.line(f"{best.id} is no longer accepted on its pooled runs: the best is {best.parent} again")
    return ran


__all__ = ["lacks_samples", "settle_best"]
