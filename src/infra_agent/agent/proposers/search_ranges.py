"""The search proposer's ranges: where it samples each knob now, and its local moves.

A numeric knob is sampled inside its *search range*: the knob's ``typical`` range when it
declares one (the values a user would try first), else its domain, and never above what
the machine allows (``resource``: a thread count above the cores, a memory size above the
memory).  The range leaves the typical one only when a finding points outward: attribution
ranks the knob and the best configuration's value sits at the range's edge.  Then that
side grows by ``WIDEN_FACTOR`` (towards the domain's bound), and the reason is recorded.

Local moves are the first questions from a best configuration: one knob at a time, x2 or
/2 for a number (rounded to the type, clipped to the search range), the neighbouring
choices for a choice or bool knob.  They answer "which way does this knob pay?" with the
fewest runs, before TPE samples the knobs jointly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from infra_agent.workspace.knobs import Knob
from infra_agent.workspace.machine import Bound, MachineLimits, knob_bound

WIDEN_FACTOR = 4  # a typical range's side grows x4 (or /4) at a time when a finding points past it


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


@dataclass
class KnobRange:
    """One searchable knob: its current range, the largest range it may reach, and why."""

    name: str
    knob: Knob
    lo: float = 0.0  # the range sampled now (numeric knobs)
    hi: float = 0.0
    floor: float = 0.0  # how far the range may grow: the domain, clipped by the machine
    ceiling: float = 0.0
    bound: Bound | None = None

    @property
    def numeric(self) -> bool:
        return self.knob.type in ("int", "float")

    def round(self, x: float) -> int | float:
        return math.floor(x + 0.5) if self.knob.type == "int" else float(x)

    def clip(self, x: float) -> int | float:
        return self.round(min(max(x, self.lo), self.hi))

    def distribution(self) -> BaseDistribution:
        if self.knob.type == "bool":
            return CategoricalDistribution([False, True])
        if self.knob.type == "choice":
            assert self.knob.choices is not None
            return CategoricalDistribution(list(self.knob.choices))
        if self.knob.type == "int":
            return IntDistribution(int(self.lo), int(self.hi), log=self.knob.log_scale)
        return FloatDistribution(float(self.lo), float(self.hi), log=self.knob.log_scale)

    def contains(self, value: Any) -> bool:
        if not self.numeric:
            return True
        return not isinstance(value, bool) and isinstance(value, (int, float)) and self.lo <= value <= self.hi

    def describe(self) -> str:
        """``int in [4, 256] (typical; machine <= 2 ...)`` for messages."""
        if not self.numeric:
            return self.knob.domain()
        return f"[{_num(self.lo)}, {_num(self.hi)}]"

    def widen_at(self, value: Any) -> str | None:
        """Grow the side of the range that ``value`` sits at the edge of, if it can grow: what grew."""
        if not self.numeric or isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        before = self.describe()
        if value >= self.hi and self.hi < self.ceiling:
            grown = self.hi * WIDEN_FACTOR if self.hi > 0 else self.ceiling
            self.hi = min(self.ceiling, math.floor(grown) if self.knob.type == "int" else grown)
            side = "upper"
        elif value <= self.lo and self.lo > self.floor:
            shrunk = self.lo / WIDEN_FACTOR if self.lo > 0 else self.floor
            self.lo = max(self.floor, math.ceil(shrunk) if self.knob.type == "int" else shrunk)
            side = "lower"
        else:
            return None
        return f"{self.name} {before} -> {self.describe()}: the best value {_num(value)} sits at its {side} edge"

    def local_moves(self, value: Any) -> list[Any]:
        """x2 and /2 of a number (rounded, clipped to the range), or the neighbouring choices."""
        if not self.numeric:
            d = self.distribution()
            assert isinstance(d, CategoricalDistribution)
            choices = list(d.choices)
            at = next((i for i, c in enumerate(choices) if type(c) is type(value) and c == value), None)
            if at is None:
                return []
            out = [choices[(at + 1) % len(choices)], choices[(at - 1) % len(choices)]]
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return []
        elif value == 0:
            out = [self.clip(1)] if self.knob.type == "int" else []
        else:
            out = [self.clip(value * 2), self.clip(value / 2)]
        moves: list[Any] = []
        for m in out:
            if not (type(m) is type(value) and m == value) and m not in moves:
                moves.append(m)
        return moves


def build_ranges(knobs: dict[str, Knob], limits: MachineLimits, typical: bool) -> dict[str, KnobRange]:
    """The search range of every knob in ``knobs`` that has one (bounded, more than one value).

    ``typical`` False (a blind search) starts at the whole domain; the machine bounds hold either way.
    """
    out: dict[str, KnobRange] = {}
    for name, knob in knobs.items():
        r = KnobRange(name, knob)
        if knob.type == "choice":
            assert knob.choices is not None
            if len(knob.choices) < 2:
                continue
        elif knob.type in ("int", "float"):
            if knob.min is None or knob.max is None:
                continue
            lo, hi = float(knob.min), float(knob.max)
            if knob.type == "int":
                lo, hi = math.ceil(lo), math.floor(hi)
            r.bound = knob_bound(name, knob, limits)
            if r.bound is not None:
                hi = min(hi, r.bound.limit)
            if lo >= hi:
                continue  # one value (or none) the machine allows: nothing to search
            r.floor, r.ceiling = lo, hi
            r.lo, r.hi = lo, hi
            if typical and knob.typical is not None:
                r.lo, r.hi = max(lo, knob.typical[0]), min(hi, knob.typical[1])
                if r.lo >= r.hi:  # the machine cuts the typical range to a point: search what it allows
                    r.lo, r.hi = lo, hi
        elif knob.type != "bool":
            continue  # str: no domain to search
        out[name] = r
    return out


__all__ = ["WIDEN_FACTOR", "KnobRange", "build_ranges"]
