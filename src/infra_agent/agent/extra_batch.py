"""One more batch of measurements, pooled with the earlier ones, when the judge cannot decide.

The run option and the CLI flag call this a *top-up* (``top_up``, ``--no-top-up``); the
experiment's later looks (agent/rounds.py), a reopened experiment and the confirmation all
run their next batch through :func:`run_extra_batch`.

An interval that straddles its threshold is the judge's way of saying "not enough
samples": with three interleaved pairs, or one check run a side, a single window
disturbed by the host (another job, a stall) is enough to leave a verdict open. The
loop then asks once for as many runs again, pools them with the first (index-paired as
before, so paired statistics stay paired) and judges again. Once, not until a verdict
appears: looking again without limit would let noise decide, and a second look already
raises the chance of a false decision a little above the nominal 5% (two looks at a
95% interval: about 8% at worst), which docs/agent.md states.
"""

from __future__ import annotations

from typing import Any

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.planner import Plan
from infra_agent.judge.pooling import pool_runs
from infra_agent.records import Experiment


def run_extra_batch(executor: Any, exp: Experiment, plan: Plan, best: Experiment, ex: Execution,
               on_event: Any = None) -> bool:
    """Run ``plan`` once more for ``exp`` against ``best`` and pool it into ``ex``.

    Returns whether the extra round completed; a failed round leaves ``ex``'s runs as
    they were (its cost is still counted)."""
    with executor.fresh_checks():  # a check's earlier run is the first round's sample, not a new one
        more: Execution = executor.execute(exp, plan, best, on_event)
    ex.wall_s += more.wall_s
    ex.e2e_runs += more.e2e_runs
    ex.probe_runs += more.probe_runs
    ex.launches += more.launches
    if more.status != "done":
        return False
    for side, extra in ((ex.baseline, more.baseline), (ex.candidate, more.candidate)):
        for key, runs in extra.items():
            side.setdefault(key, []).extend(runs)
    for name, fb in more.checks.items():
        # The cheap gates ran again on the same candidate: their runs pool, as the windows do.
        pooled = pool_runs([ex.checks[name], fb]) if name in ex.checks else fb
        ex.checks[name] = pooled if pooled is not None else fb
    return True
