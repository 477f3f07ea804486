"""Bootstrap confidence interval of a candidate/baseline ratio of a statistic.

Percentile bootstrap, seeded, vectorised in blocks to bound memory.  With few samples
the plain percentile interval is too narrow (it ignores that the spread itself is
estimated), which would turn noise into "significant" differences.  We therefore use
Hesterberg's *expanded* percentile interval: the tail probability is shrunk to
α' = 2·Φ(−√(n/(n−1))·t_{1−α/2, n−1}), which matches a t-interval's width for small n
and converges to the plain interval as n grows.

``paired=True`` resamples index pairs jointly (A and B runs taken side by side in an
interleaved A B A B schedule), so drift shared by a pair cancels in the ratio.

``process_noise`` adds what resampling runs cannot see: two server processes started
with the same settings differ by a per-process offset (memory layout, where threads
land), so A's and B's processes differ by one even with no real change.  Resampling
runs of those two processes measures the two processes, not the settings.  When the
offset's spread is known (``process_noise`` = the standard deviation of the log ratio
between two fresh, identically configured processes, measured by an A/A calibration
such as ``bench/ab_power.py``), each bootstrap replicate's log ratio gets an independent
normal draw with variance ``process_noise² / restarts``: restarts (fresh processes per
side, see ``interleave_knobs``) average that many independent offsets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from infra_agent.stats.dist import norm_cdf, t_ppf

StatFn = Callable[[np.ndarray], np.ndarray]  # reduces axis 1 of a (B, n) block

_BLOCK_ELEMENTS = 4_000_000


@dataclass(frozen=True)
class RatioCI:
    ratio: float  # stat(candidate) / stat(baseline) on the observed samples
    low: float
    high: float
    confidence: float
    stat: str
    n_candidate: int
    n_baseline: int
    paired: bool
    n_boot: int
    process_noise: float = 0.0
    restarts: int = 1

    @property
    def n(self) -> int:
        """The effective sample count that governs the width (pairs, or the smaller side)."""
        return min(self.n_candidate, self.n_baseline)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def stat_function(stat: str) -> StatFn:
    """``mean``, ``median`` or ``pNN`` (a percentile), reducing along axis 1."""
    if stat == "mean":
        return lambda a: a.mean(axis=1)
    if stat == "median":
        return lambda a: np.median(a, axis=1)
    if stat.startswith("p") and stat[1:].replace(".", "", 1).isdigit():
        q = float(stat[1:])
        return lambda a: np.percentile(a, q, axis=1)
    raise ValueError(f"unknown statistic {stat!r}; expected mean, median or pNN")


def expanded_alpha(n: int, confidence: float) -> float:
    """Tail mass (both tails) for Hesterberg's expanded percentile interval."""
    alpha = 1.0 - confidence
    if n < 2:
        return alpha
    t = t_ppf(1 - alpha / 2, n - 1)
    return 2 * norm_cdf(-math.sqrt(n / (n - 1)) * t)


def _boot_stats(rng: np.random.Generator, x: np.ndarray, idx_source: Callable[[int], np.ndarray], fn: StatFn, n_boot: int) -> np.ndarray:
    out = np.empty(n_boot)
    block = max(1, _BLOCK_ELEMENTS // max(1, x.size))
    for start in range(0, n_boot, block):
        b = min(block, n_boot - start)
        out[start : start + b] = fn(x[idx_source(b)])
    return out


def bootstrap_ratio(
    candidate: Sequence[float],
    baseline: Sequence[float],
    *,
    stat: str = "median",
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    paired: bool = False,
    process_noise: float = 0.0,
    restarts: int = 1,
) -> RatioCI:
    """CI of stat(candidate)/stat(baseline).  Values must be positive (times, rates).

    ``process_noise``/``restarts``: see the module docstring; 0 leaves the interval
    about the runs alone.
    """
    if process_noise < 0 or restarts < 1:
        raise ValueError(f"process_noise must be >= 0 and restarts >= 1, got {process_noise} and {restarts}")
    c = np.asarray(candidate, dtype=np.float64)
    b = np.asarray(baseline, dtype=np.float64)
    if c.size == 0 or b.size == 0:
        raise ValueError("both sides need at least one sample")
    if paired and c.size != b.size:
        raise ValueError(f"paired bootstrap needs equal counts, got {c.size} and {b.size}")
    fn = stat_function(stat)
    ratio = float(fn(c[None, :])[0] / fn(b[None, :])[0])
    rng = np.random.default_rng(seed)
    if paired:
        n = c.size
        # Draw one index matrix per block and apply it to both sides.
        both = np.stack([c, b])
        out_c = np.empty(n_boot)
        out_b = np.empty(n_boot)
        block = max(1, _BLOCK_ELEMENTS // max(1, 2 * n))
        for start in range(0, n_boot, block):
            k = min(block, n_boot - start)
            idx = rng.integers(0, n, size=(k, n))
            out_c[start : start + k] = fn(both[0][idx])
            out_b[start : start + k] = fn(both[1][idx])
        ratios = out_c / out_b
        n_eff = n
    else:
        sc = _boot_stats(rng, c, lambda k: rng.integers(0, c.size, size=(k, c.size)), fn, n_boot)
        sb = _boot_stats(rng, b, lambda k: rng.integers(0, b.size, size=(k, b.size)), fn, n_boot)
        ratios = sc / sb
        n_eff = min(c.size, b.size)
    if process_noise > 0:
        ratios = ratios * np.exp(rng.normal(0.0, process_noise / math.sqrt(restarts), size=ratios.size))
    ratios = ratios[np.isfinite(ratios)]
    alpha = expanded_alpha(n_eff, confidence)
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2]) if ratios.size else (math.nan, math.nan)
    return RatioCI(
        ratio=ratio, low=float(low), high=float(high), confidence=confidence, stat=stat,
        n_candidate=int(c.size), n_baseline=int(b.size), paired=paired, n_boot=n_boot,
        process_noise=process_noise, restarts=restarts,
    )


@dataclass(frozen=True)
class StatCI:
    """A bootstrap interval of one statistic of one sample (same method as ``bootstrap_ratio``)."""

    value: float
    low: float
    high: float
    confidence: float
    stat: str
    n: int

    @property
    def label(self) -> str:
        return f"{self.confidence:.0%} bootstrap CI of the {self.stat}"


def bootstrap_ci(samples: Sequence[float], *, stat: str = "median", confidence: float = 0.95, n_boot: int = 1000,
                 seed: int = 0) -> StatCI:
    """Expanded-percentile bootstrap interval of ``stat(samples)``; with one sample it is that sample."""
    x = np.asarray(samples, dtype=np.float64)
    if x.size == 0:
        raise ValueError("need at least one sample")
    fn = stat_function(stat)
    value = float(fn(x[None, :])[0])
    if x.size == 1:
        return StatCI(value, value, value, confidence, stat, 1)
    rng = np.random.default_rng(seed)
    boots = _boot_stats(rng, x, lambda k: rng.integers(0, x.size, size=(k, x.size)), fn, n_boot)
    alpha = expanded_alpha(int(x.size), confidence)
    low, high = np.quantile(boots, [alpha / 2, 1 - alpha / 2])
    return StatCI(value, float(low), float(high), confidence, stat, int(x.size))


# Below this many samples a percentile bootstrap cannot reach past the range of the
# data (with 3 paired runs the interval is at most the range of 3 ratios), so it
# covers the truth far less than 95% of the time.  The judge then uses a t-interval
# on the logarithms instead: exact for log-normal noise, and as wide as a small sample
# deserves.  An A/A simulation (tests/infra_agent/judge/test_small_sample.py) holds it
# to its nominal coverage.
SMALL_N = 10


def t_interval_log(values: Sequence[float], *, confidence: float = 0.95) -> tuple[float, float, float]:
    """(geometric mean, low, high): a t-interval of the mean of log(values), mapped back."""
    x = np.log(np.asarray(values, dtype=np.float64))
    n = x.size
    centre = float(x.mean())
    if n < 2:
        v = float(np.exp(centre))
        return v, v, v
    half = t_ppf(0.5 + confidence / 2, n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return float(np.exp(centre)), float(np.exp(centre - half)), float(np.exp(centre + half))
