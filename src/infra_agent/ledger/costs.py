"""What probes really cost, learned from the ledger: the planner's price list.

The planner picks the cheapest probe whose scope covers a question; a static tier order
says which is cheaper in principle, these numbers say by how much on this machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import NamedTuple


class ProbeCost(NamedTuple):
    """What a (probe, tier) cost, over finished experiments of all runs."""

    n: int
    mean_s: float
    median_s: float


def probe_costs(walls: Iterable[tuple[str, str, float]]) -> dict[tuple[str, str], ProbeCost]:
    """(probe, tier, wall seconds) observations -> cost per (probe, tier).

    Observations of no time (an experiment rejected before it ran) carry no cost signal
    and would drag the estimate toward zero, so they are left out.
    """
    grouped: dict[tuple[str, str], list[float]] = {}
    for probe, tier, wall_s in walls:
        if wall_s > 0:
            grouped.setdefault((probe, tier), []).append(wall_s)
    return {key: ProbeCost(len(v), statistics.fmean(v), statistics.median(v)) for key, v in grouped.items()}
