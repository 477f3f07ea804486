"""The baseline: the workspace as given, measured once; its gate table is the *before* table.

Every scenario a criterion names (or the run's ``--scenarios``), ``pairs`` serving
windows each, and every check.  A baseline that could not be measured ends the run
with the reason; ``resume`` measures it again under the same id (after the launch was
fixed, say), and a finished one is never measured twice.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infra_agent.judge.accept import gates_of
from infra_agent.judge.pooling import side_feedback
from infra_agent.records import Cost, Experiment, Hypothesis, Verdict

if TYPE_CHECKING:
    from infra_agent.agent.loop import Loop


def run_baseline(loop: Loop) -> bool:
    """Measure the baseline unless it is measured already; False (the reason in the run record) if it
    cannot be."""
    base = loop.baseline()
    if base is not None and base.status == "done":
        return True  # a baseline that failed (status error) is measured again on resume
    seq = loop.ledger.next_seq(loop.run.id) if base is None else base.seq
    base = base or Experiment(id="e0", run_id=loop.run.id, seq=seq, role="baseline", proposer="-",
                              hypothesis=Hypothesis(statement="baseline: the workspace as given", metric="-", direction="higher"),
                              knobs=dict(loop.ws.resolve_knobs()))
    base.status, base.started_at, base.error = "running", time.time(), None
    loop.run.baseline = loop.run.best = base.id
    loop.record(base)
    loop.record_run()
    scenarios = loop.opts.get("scenarios") or sorted({c.scenario for c in loop.ws.criteria if c.scenario} or loop.ws.scenarios)
    metrics = sorted({c.metric for c in loop.ws.criteria})
    loop.progress.experiment(base, f"serving/e2e x{loop.opts['pairs']} on {', '.join(scenarios)} + {len(loop.ws.checks)} check(s)")
    ex = loop.executor.measure(base, scenarios, int(loop.opts["pairs"]), [c.name for c in loop.ws.checks],
                               loop.progress.event, result_metrics=metrics)
    base.feedback, base.checks = side_feedback(ex.candidate), dict(ex.checks)
    base.cost = Cost(wall_s=ex.wall_s, e2e_runs=ex.e2e_runs, probe_runs=ex.probe_runs, launches=ex.launches,
                     tier=base.feedback.tier if base.feedback else None)
    base.finished_at = time.time()
    if ex.status != "done":
        base.status, base.error = "error", ex.error
        loop.run.status, loop.run.message = "error", f"the baseline could not be measured: {ex.error}"
        loop.record(base)
        loop.progress.line(loop.run.message)
        return False
    gates = gates_of(loop.ws, ex, base.id, None, relative=False)
    base.status = "done"
    base.verdict = Verdict(outcome="baseline", gates=gates, accepted=True, message="baseline measurement")
    loop.run.gates_before = gates
    loop.record(base)
    loop.progress.finished(base, base, gates)
    return True
