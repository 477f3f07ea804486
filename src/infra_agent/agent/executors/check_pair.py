"""The check an experiment is about, run on both sides (a plan of mode ``pair``).

A correctness check is deterministic: it runs once per side, and the parent's result
comes from the executor's cache (the same check on the same code and configuration).

A timing (a kernel bench, tier micro) is not.  Timed minutes apart, under whatever else
the machine ran meanwhile, the two sides would differ by the load rather than by the
code: on a busy 2-core machine a candidate timed in a quiet moment read 2.2x the
bandwidth of its own baseline, timed earlier, for an edit that changed only a comment.
So a timed check runs ``pairs`` rounds of fresh runs, parent and candidate back to back
in A B, B A, A B order, and the judge takes one value per run (judge/gates.py), paired
by round, as it pairs a serving A/B's windows.  A candidate run that fails (refused
while timed, wrong outputs) ends the rounds and is all that is kept of them, with its
round's parent: the verdict rests on that failure, and a few good rounds before it must
not read as a promising, undecided experiment that earns more batches.  A round whose
parent run failed is dropped whole, so the rounds kept stay paired.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, OnEvent
from infra_agent.agent.planner import Plan, is_timed_pair
from infra_agent.feedback import Feedback
from infra_agent.records import Experiment
from infra_agent.serving.interleave import pair_order


def run_check_pair(executor: Any, exp: Experiment, best: Experiment, plan: Plan, dirs: tuple[Path, Path],
                   extra: dict[str, Any], ex: Execution, on_event: OnEvent | None) -> None:
    """Run ``plan.check`` on the parent (``dirs[0]``, ``best``'s knobs) and the candidate
    (``dirs[1]``), once each or in interleaved rounds for a timing, into ``ex``."""
    assert plan.check is not None
    rounds = max(1, int(executor.pairs)) if is_timed_pair(plan) else 1
    sides = {"a": (dirs[0], best.knobs, ex.baseline), "b": (dirs[1], exp.knobs, ex.candidate)}
    fresh = executor.fresh
    executor.fresh = fresh or rounds > 1  # a timed parent is run again beside its candidate, not taken from the cache
    kept: list[dict[str, Feedback]] = []
    try:
        for r in range(rounds):
            ran: dict[str, Feedback] = {}
            for side in pair_order(r, "abba"):
                ws_dir, knobs, _ = sides[side]
                ran[side] = executor._probe(exp.id, ws_dir, plan.check, knobs, extra, on_event)
                ex.probe_runs += 1
                if side == "b" and not ran[side].ok:
                    break
            if "b" in ran and not ran["b"].ok:
                if "a" not in ran and kept:  # B A order: the parent of the round before stands beside it
                    ran = {"a": kept[-1]["a"], **ran}
                kept = [ran]
                break
            if all(fb.ok for fb in ran.values()) or r == 0:
                kept.append(ran)  # round 0 always: a check that fails on both sides is the verdict
            if not all(fb.ok for fb in ran.values()):
                break
    finally:
        executor.fresh = fresh
    for ran in kept:
        for side, fb in sorted(ran.items()):
            sides[side][2].setdefault(plan.check, []).append(fb)


__all__ = ["run_check_pair"]
