"""Gates and the decision rule: ``pass``, ``fail`` or ``inconclusive`` from a ratio's interval.

A gate (``output_throughput>=0.95``) is a threshold on the candidate/baseline ratio.
``decide`` passes it when the whole confidence interval satisfies it, fails it when
the whole interval violates it, and otherwise says how many more samples would likely
decide (assuming the width falls as 1/√n and the estimate holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from infra_agent.stats.bootstrap import RatioCI

Op = Literal[">=", "<=", ">", "<"]
Outcome = Literal["pass", "fail", "inconclusive"]


@dataclass(frozen=True)
class Gate:
    """``metric op threshold`` on the candidate/baseline ratio."""

    metric: str
    op: Op
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


@dataclass(frozen=True)
class GateDecision:
    """One gate decided on one interval (a record of the judge's GateResult is built from it)."""

    gate: str
    outcome: Outcome
    ratio: float | None
    low: float | None
    high: float | None
    # For inconclusive: how many more samples (of the kind the interval used) would
    # likely decide it; None when the estimate sits on the threshold or no CI exists.
    more_samples: int | None = None
    message: str = ""


# Below this many samples per side a bootstrap has too few distinct resamples for its
# interval to carry a 95% meaning (with 2, it is about the range of the two values).
MIN_SAMPLES = 3


def decide(gate: Gate, ci: RatioCI | None) -> GateDecision:
    if ci is None or not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return GateDecision(str(gate), "inconclusive", None if ci is None else ci.ratio, None, None, None,
                       f"no confidence interval: repeat the runs (interleaved) so each side has >= {MIN_SAMPLES}")
    if ci.n < MIN_SAMPLES:
        more = max(MIN_SAMPLES - ci.n, more_samples_needed(ci, gate.threshold) or 0)
        return GateDecision(str(gate), "inconclusive", ci.ratio, ci.low, ci.high, more,
                       f"only {ci.n} sample(s) per side; an interval needs >= {MIN_SAMPLES} to decide anything")
    lower_bound = gate.op in (">=", ">")
    # The side of the interval that faces the threshold decides.
    strict = gate.op in (">", "<")
    if lower_bound:
        passed = ci.low > gate.threshold if strict else ci.low >= gate.threshold
        failed = ci.high <= gate.threshold if strict else ci.high < gate.threshold
    else:
        passed = ci.high < gate.threshold if strict else ci.high <= gate.threshold
        failed = ci.low >= gate.threshold if strict else ci.low > gate.threshold
    if passed or failed:
        outcome: Outcome = "pass" if passed else "fail"
        msg = f"{ci.confidence:.0%} CI [{ci.low:.4f}, {ci.high:.4f}] lies {'inside' if passed else 'outside'} {gate}"
        return GateDecision(str(gate), outcome, ci.ratio, ci.low, ci.high, None, msg)
    return GateDecision(str(gate), "inconclusive", ci.ratio, ci.low, ci.high, more_samples_needed(ci, gate.threshold),
                   f"{ci.confidence:.0%} CI [{ci.low:.4f}, {ci.high:.4f}] straddles {gate.threshold:g}")


def more_samples_needed(ci: RatioCI, threshold: float) -> int | None:
    distance = abs(ci.ratio - threshold)
    if distance < 1e-12:
        return None
    # The half of the interval between the estimate and the threshold must shrink
    # below `distance`; width ~ 1/sqrt(n).
    half = (ci.ratio - ci.low) if ci.ratio > threshold else (ci.high - ci.ratio)
    n_needed = ci.n * (half / distance) ** 2
    return max(1, math.ceil(n_needed - ci.n))


__all__ = ["MIN_SAMPLES", "Gate", "GateDecision", "Op", "Outcome", "decide", "more_samples_needed"]
