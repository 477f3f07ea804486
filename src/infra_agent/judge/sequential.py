"""Looking at an experiment after every batch of pairs without inflating false decisions.

A comparison that stops as soon as its interval clears a line, and otherwise runs
another batch, looks at the data several times.  With a 95% interval at each look the
chance that *some* look excludes the truth grows with the looks (two looks: about 8%;
five: about 14%).  Clinical trials solved this with group-sequential designs: the number
of looks is fixed before the first one, and every look uses a wider interval, so that
the chance of a false decision over all of them stays at alpha.

This is Pocock's design: the same level at each of ``K`` equally spaced looks, chosen so
that the chance of any look excluding the truth is alpha.  With a known spread that is
the constant ``c_K`` at which a standard normal random walk observed at those looks leaves
``[-c_K, c_K]`` with probability alpha (``c_2 = 2.178``, ``c_4 = 2.361`` for alpha 0.05,
i.e. 97.1% and 98.2% per look).  The judge's looks are t-intervals whose spread is
estimated anew from few pairs, so the per-look level is calibrated for them
(:func:`t_look_confidence`, a seeded simulation: 97.3% for 2 looks of 3 pairs, 98.4% for
4), and ``c_K`` serves the sample-size plan.  Its false-positive rate over all looks and its power are
measured in tests/infra_agent/judge/test_sequential.py and by ``bench/ab_power.py
--designs``.  Pocock rather than O'Brien-Fleming: with 2 to 4 looks of 3 pairs each, an
early look at O'Brien-Fleming's level almost never stops, and stopping early on a clear
answer is the point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from infra_agent.stats.dist import norm_ppf, t_ppf, t_sf

# c_K at alpha 0.05 (Jennison & Turnbull, table 2.1), so that the loop does not integrate a
# K-variate normal each time (8 looks take ~20 s); test_sequential.py recomputes K = 2 to 4.
_POCOCK_05 = {2: 2.1783, 3: 2.2895, 4: 2.3613, 5: 2.4132, 6: 2.4532, 7: 2.4855, 8: 2.5124, 9: 2.5352, 10: 2.5550}


def pocock_constant(looks: int, alpha: float = 0.05) -> float:
    """``c_K``: the two-sided critical value for ``looks`` equally spaced looks at overall ``alpha``."""
    if looks < 1:
        raise ValueError(f"looks must be >= 1, got {looks}")
    if looks == 1:
        return norm_ppf(1 - alpha / 2)
    if alpha == 0.05 and looks in _POCOCK_05:
        return _POCOCK_05[looks]
    return compute_pocock_constant(looks, alpha)


@lru_cache(maxsize=32)
def compute_pocock_constant(looks: int, alpha: float = 0.05) -> float:
    """``c_K`` by integrating the K-variate normal of the looks' z statistics (slow for many looks)."""
    # Z_k at look k of K equally spaced looks: corr(Z_i, Z_j) = sqrt(i / j) for i <= j.
    idx = np.arange(1, looks + 1, dtype=np.float64)
    cov = np.sqrt(np.minimum.outer(idx, idx) / np.maximum.outer(idx, idx))
    # The K-variate normal is scipy.stats' alone; imported only for a design not in the table.
    from scipy import stats as sstats

    mvn = sstats.multivariate_normal(mean=np.zeros(looks), cov=cov, seed=0)

    def stays_inside(c: float) -> float:
        return float(mvn.cdf(np.full(looks, c), lower_limit=np.full(looks, -c)))

    lo, hi = norm_ppf(1 - alpha / 2), 4.0
    for _ in range(24):  # bisection on P(all |Z_k| < c) = 1 - alpha
        mid = (lo + hi) / 2
        if stays_inside(mid) < 1 - alpha:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


@dataclass(frozen=True)
class SequentialDesign:
    """``looks`` batches of ``batch`` pairs at most, each look at the Pocock level."""

    looks: int
    batch: int
    alpha: float = 0.05

    def __post_init__(self) -> None:
        assert self.looks >= 1 and self.batch >= 1 and 0 < self.alpha < 1

    @property
    def max_pairs(self) -> int:
        return self.looks * self.batch

    @property
    def critical_value(self) -> float:
        return pocock_constant(self.looks, self.alpha)

    @property
    def confidence(self) -> float:
        """The confidence of each look's t-interval: Pocock's level, calibrated for t statistics.

        Pocock's constant assumes a known spread; here each look estimates it anew from
        few pairs (2, 5, 8 ... degrees of freedom), and plugging ``c_K`` into t quantiles
        lets a little more than alpha through (6.0% at 4 looks of 3 pairs).  So the
        per-look level is the one that holds the chance of any look excluding the truth
        at alpha for normal noise: :func:`t_look_confidence`."""
        if self.looks == 1:
            return 1.0 - self.alpha
        return t_look_confidence(self.looks, self.batch, self.alpha)

    def describe(self) -> str:
        if self.looks == 1:
            return f"one look at {self.batch} pairs ({1 - self.alpha:.0%} interval)"
        return (f"up to {self.looks} looks of {self.batch} pairs (Pocock: {self.confidence:.1%} interval at each look, "
                f"{1 - self.alpha:.0%} over all)")


@lru_cache(maxsize=64)
def t_look_confidence(looks: int, batch: int, alpha: float = 0.05, replicates: int = 200_000) -> float:
    """The per-look confidence at which ``looks`` t-intervals, after every ``batch`` pairs,
    exclude the truth at some look with probability ``alpha`` (normal noise, unknown spread).

    Monte Carlo with a fixed seed (deterministic): the per-look two-sided p-value of each
    look with at least 3 pairs (fewer decide nothing, stats/decision.py), the smallest over
    the looks, and its ``alpha`` quantile is the per-look level."""
    if looks * batch < 3:
        return 1.0 - alpha  # no look can decide anything
    rng = np.random.default_rng(12345)
    n_max = looks * batch
    x = rng.standard_normal((replicates, n_max))
    csum, csq = np.cumsum(x, axis=1), np.cumsum(x * x, axis=1)
    p_min = np.ones(replicates)
    for k in range(1, looks + 1):
        n = k * batch
        if n < 3:
            continue
        mean = csum[:, n - 1] / n
        var = (csq[:, n - 1] - n * mean * mean) / (n - 1)
        t = np.abs(mean) / np.sqrt(np.maximum(var, 1e-300) / n)
        p_min = np.minimum(p_min, 2 * t_sf(t, n - 1))
    return float(1.0 - np.quantile(p_min, alpha))


def fixed_design_pairs(sd: float, min_effect: float, *, power: float = 0.9, confidence: float = 0.95,
                       cap: int = 1000, process_noise: float = 0.0, batch: int | None = None) -> int:
    """Pairs a look at ``confidence`` needs to decide a ratio gate ``min_effect`` away from the truth at ``power``.

    ``sd`` is the spread of per-pair log ratios; the effect is the distance, in log ratio,
    between "no change" and the hypothesis's line (``log(1 + min_effect)``): with that many
    pairs a no-op is refuted, and a change of twice the minimum supported, ``power`` of the
    time (t quantiles at ``n - 1`` degrees of freedom: :func:`detectable_effect` inverted).
    ``process_noise``: the spread between fresh process pairs, one per ``batch`` of pairs
    (judge/process_noise.py); more pairs in one batch do not average it out, more batches do.
    """
    if sd <= 0 and process_noise <= 0:
        return 3
    delta = math.log1p(min_effect)
    if delta <= 0:
        return cap
    for n in range(3, cap + 1):  # the smallest n whose t-based detectable effect is within min_effect
        if detectable_effect(sd, n, power=power, confidence=confidence, process_noise=process_noise,
                             batch=batch) <= min_effect:
            return n
    return cap


def detectable_effect(sd: float, pairs: int, *, power: float = 0.9, confidence: float = 0.95,
                      process_noise: float = 0.0, batch: int | None = None) -> float:
    """The smallest ``min_effect`` that ``pairs`` pairs decide at ``power`` (the inverse of the above).

    Each side of the sum is the interval's half-width at that quantile (stats/intervals.py):
    the pairs' part at t, the process term over ``ceil(pairs / batch)`` restarts at the
    normal quantile, in quadrature."""
    if pairs < 3:
        return math.inf
    restarts = math.ceil(pairs / batch) if batch else 1
    known = process_noise / math.sqrt(restarts)
    own = sd / math.sqrt(pairs)
    t_a = t_ppf(0.5 + confidence / 2, pairs - 1)
    t_b = t_ppf(power, pairs - 1)
    z_a = norm_ppf(0.5 + confidence / 2)
    z_b = norm_ppf(power)
    return math.expm1(math.hypot(t_a * own, z_a * known) + math.hypot(t_b * own, z_b * known))


__all__ = ["SequentialDesign", "detectable_effect", "fixed_design_pairs", "pocock_constant"]
