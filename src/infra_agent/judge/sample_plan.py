"""The sample-size plan of one experiment: how many interleaved pairs its minimum effect needs.

Before an A/B runs, the judge states what it will take to decide it, from the noise the
run has seen so far:

- **The noise** is the spread of per-pair log ratios of the hypothesis's metric.  The
  baseline's repeated windows of one configuration give a first estimate (the spread of
  their logs times sqrt(2): a ratio has two sides; this ignores that interleaving cancels
  drift, so it errs wide); every A/B the run has judged since gives the direct one (the
  spread of its per-pair log ratios around their own mean, pooled over experiments).
  Both are combined by their degrees of freedom (:func:`estimate_noise`).
- **The pairs needed** to decide a change of ``min_effect``: enough that a no-op is
  refuted, and a change of twice the minimum supported, 90% of the time
  (:func:`~infra_agent.judge.sequential.fixed_design_pairs`), at the interval the
  sequential design uses.
- **The design**: batches of ``batch`` pairs (``--pairs``), looked at after each, up to
  ``max_pairs`` (``--max-pairs``), with Pocock's per-look interval
  (:mod:`infra_agent.judge.sequential`); it stops at the first look that decides.
- **The spread between server processes** (``process_noise``, judge/process_noise.py):
  every batch starts a fresh pair of servers, whose offset the batch's pairs share; it
  averages out over batches, not over pairs, so it raises the pairs needed (in batches).
- **When the cap cannot do it**, the plan says so before the runs are spent, with the
  smallest effect the cap can detect at this noise, and what would help.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from infra_agent.judge.sequential import (
    SequentialDesign,
    detectable_effect,
    fixed_design_pairs,
)

POWER = 0.9
CAP = 1000  # pairs: beyond this the plan says "more than 1000"


@dataclass(frozen=True)
class Noise:
    sd: float  # spread of per-pair log ratios
    df: int  # the degrees of freedom behind it
    source: str

    def text(self) -> str:
        return f"{self.sd:.1%} per pair ({self.source})"


def noise_from_windows(values: Sequence[float]) -> Noise | None:
    """From repeated windows of one configuration (the baseline): the spread of their logs, times sqrt(2)."""
    logs = np.log([v for v in values if v > 0])
    if logs.size < 2:
        return None
    sd = float(logs.std(ddof=1)) * math.sqrt(2.0)
    return Noise(sd=sd, df=int(logs.size - 1), source=f"{logs.size} baseline windows x sqrt(2)")


def noise_from_pairs(groups: Sequence[Sequence[float]]) -> Noise | None:
    """From per-pair log ratios of judged A/Bs, pooled within each (each around its own mean)."""
    ss, df, pairs = 0.0, 0, 0
    for g in groups:
        arr = np.asarray([x for x in g if math.isfinite(x)], dtype=np.float64)
        if arr.size >= 2:
            ss += float(((arr - arr.mean()) ** 2).sum())
            df += int(arr.size - 1)
            pairs += int(arr.size)
    if df == 0:
        return None
    return Noise(sd=math.sqrt(ss / df), df=df, source=f"{pairs} pairs of {sum(1 for g in groups if len(g) >= 2)} A/B(s)")


def estimate_noise(windows: Noise | None, paired: Noise | None) -> Noise | None:
    """Both estimates pooled by their degrees of freedom (either may be missing)."""
    parts = [n for n in (windows, paired) if n is not None]
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    df = sum(n.df for n in parts)
    var = sum(n.df * n.sd ** 2 for n in parts) / df
    return Noise(sd=math.sqrt(var), df=df, source=" + ".join(n.source for n in parts))


@dataclass(frozen=True)
class SamplePlan:
    metric: str
    min_effect: float
    batch: int
    max_pairs: int
    design: SequentialDesign
    noise: Noise | None
    needed: int | None  # pairs the design needs at 90% power; None when the noise is unknown
    detectable: float | None  # the smallest min_effect max_pairs detect at 90% power
    process_noise: float = 0.0  # the spread between fresh server processes (one pair per batch)

    @property
    def feasible(self) -> bool:
        return self.needed is None or self.needed <= self.max_pairs

    def text(self) -> str:
        """One paragraph, said before the runs are spent."""
        head = f"{self.design.describe()}"
        if self.noise is None:
            return f"sample plan: {head}; the noise of {self.metric} is not known yet"
        between = (f", {self.process_noise:.1%} between server processes, one pair of them per batch"
                   if self.process_noise > 0 else "")
        need = (f"a {self.min_effect:.0%} change in {self.metric} needs ~{self.needed} pairs at {POWER:.0%} power "
                f"(noise {self.noise.text()}{between})")
        if self.feasible:
            return f"sample plan: {need}; {head}"
        smallest = f"{self.detectable:.1%}" if self.detectable is not None and math.isfinite(self.detectable) else "none"
        return (f"sample plan: {need}, more than the cap of {self.max_pairs}: at this noise {self.max_pairs} pairs "
                f"detect only a change of {smallest} or more; running {head} anyway (a larger effect still shows); "
                f"what would help: longer windows (more requests per scenario), pinned cores or a quieter machine, "
                f"--max-pairs {self.needed}"
                + (" (in many more batches: the spread between server processes averages out over batches, "
                   "not over pairs in one)" if self.process_noise > 0 else "")
                + ", or a larger minimum effect")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["design"] = {**asdict(self.design), "confidence": self.design.confidence}
        out["text"] = self.text()
        return out


def plan_sample(metric: str, min_effect: float, noise: Noise | None, *, batch: int, max_pairs: int,
                sequential: bool = True, process_noise: float = 0.0) -> SamplePlan:
    """The design for one experiment: the fewest looks of ``batch`` pairs (at least two when
    ``sequential``, since the noise is an estimate) whose cap covers the pairs needed, within
    ``max_pairs``.  ``process_noise``: the spread between fresh server processes (each batch
    starts a new pair of them), judge/process_noise.py."""
    max_looks = max(1, max_pairs // batch)
    min_looks = min(2, max_looks) if sequential else 1
    if noise is None or min_effect <= 0:
        looks = min_looks
        design = SequentialDesign(looks=looks, batch=batch)
        return SamplePlan(metric, min_effect, batch, max_pairs, design, noise, None, None, process_noise)
    top = max_looks if sequential else 1
    looks, needed = top, None
    for k in range(min_looks, top + 1):
        needed = fixed_design_pairs(noise.sd, min_effect, power=POWER, confidence=SequentialDesign(k, batch).confidence,
                                    cap=CAP, process_noise=process_noise, batch=batch)
        if needed <= k * batch:
            looks = k
            break
    design = SequentialDesign(looks=looks, batch=batch)
    needed = fixed_design_pairs(noise.sd, min_effect, power=POWER, confidence=design.confidence, cap=CAP,
                                process_noise=process_noise, batch=batch)
    detectable = detectable_effect(noise.sd, design.max_pairs, power=POWER, confidence=design.confidence,
                                   process_noise=process_noise, batch=batch)
    return SamplePlan(metric, min_effect, batch, max_pairs, design, noise, needed, detectable, process_noise)


__all__ = ["CAP", "POWER", "Noise", "SamplePlan", "estimate_noise", "noise_from_pairs", "noise_from_windows", "plan_sample"]
