"""The judge's one interval family: t-intervals on the logarithms of ratios.

Every decision the judge makes about "is B at least x times A" comes down to ratios.
With interleaved runs these are per-pair ratios ``b_i / a_i`` (drift shared by a pair
cancels in the ratio).  Their logarithms are close to normal on a shared machine (the
noise is multiplicative), and with a handful of pairs the spread itself is uncertain:
the t quantile with ``n - 1`` degrees of freedom widens the interval exactly as much as
that needs.  A percentile bootstrap of 3 to 9 ratios cannot reach past their range and
covers the truth far less often than it claims (with 3 pairs the bootstrap interval is
the range of the 3 ratios: in 12 identical back-to-back A/A pairs resampled 3 at a time
it excluded 1.0 in 24-28% of the draws).  So ``compare``, the loop, the checks'
statistics and the MCP tools all use these functions; the bootstrap stays available in
``compare --interval bootstrap``, labelled, for users who ask for it.

- :func:`log_ratio_interval`: per-pair ratios (already divided) -> geometric mean and
  its interval;
- :func:`paired_ratio_interval`: the two sides' per-run values, index-paired;
- :func:`unpaired_ratio_interval`: two sides of different run counts (Welch's t on the
  logs: the ratio of geometric means);
- ``process_noise``/``restarts``: the spread of the per-process offset between two
  fresh, identically configured server processes (``infra-agent calibrate``,
  ``bench/ab_power.py``) divided over the restarts behind the runs, added in quadrature
  at the normal quantile (it is known, not estimated from these runs: :func:`_t_half`).

``confidence`` may be above 0.95: a sequential design (judge/sequential.py) looks at the
data after every batch and uses a wider interval per look so that the chance of a false
decision over all looks stays at 5%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from infra_agent.stats.bootstrap import RatioCI
from infra_agent.stats.dist import norm_ppf, t_ppf


def _check(values: Sequence[float], what: str) -> np.ndarray:
    arr = np.asarray([float(v) for v in values], dtype=np.float64)
    if arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{what} must be positive and finite, got {list(arr)}")
    return arr


def _exp(x: float) -> float:
    """exp that saturates to inf instead of raising (a ratio of 1e308 to 1e-300 in a malformed file)."""
    return math.exp(x) if x < 709.0 else math.inf


def _t_half(sd: float, n: int, confidence: float, extra_var: float = 0.0, df: float | None = None) -> float:
    """The interval's half-width: the pairs' own part at the t quantile, the known process
    term (``extra_var``: ``tau^2 / R``, calibrated beforehand) at the normal one, added in
    quadrature.

    The process term's spread is not estimated from these pairs, so stretching it by the
    t quantile of 2 degrees of freedom (4.30 against 1.96 at 95%) would make a 3-pair look
    useless; Satterthwaite's degrees of freedom for the sum would go the other way, and
    narrow a 3-pair interval below what the pairs alone give.  The sum of the halves'
    squares is never narrower than either part: adding a known term only widens."""
    if n < 2 and extra_var <= 0:
        return 0.0
    dof = df if df is not None else max(n - 1, 1)
    own = t_ppf(0.5 + confidence / 2, dof) * sd / math.sqrt(n) if n >= 2 else 0.0
    known = norm_ppf(0.5 + confidence / 2) * math.sqrt(max(extra_var, 0.0))
    return math.hypot(own, known)


def log_ratio_interval(ratios: Sequence[float], *, confidence: float = 0.95, process_noise: float = 0.0,
                       restarts: int = 1) -> RatioCI:
    """The geometric mean of ``ratios`` with its t-interval on the logs (one ratio: no width)."""
    logs = np.log(_check(ratios, "ratios"))
    n = int(logs.size)
    centre = float(logs.mean())
    sd = float(logs.std(ddof=1)) if n > 1 else 0.0
    half = _t_half(sd, n, confidence, process_noise ** 2 / max(restarts, 1)) if n > 1 else 0.0
    return RatioCI(ratio=_exp(centre), low=_exp(centre - half), high=_exp(centre + half),
                   confidence=confidence, stat="geomean", n_candidate=n, n_baseline=n, paired=True, n_boot=0,
                   process_noise=process_noise, restarts=restarts)


def paired_ratio_interval(candidate: Sequence[float], baseline: Sequence[float], *, confidence: float = 0.95,
                          process_noise: float = 0.0, restarts: int = 1) -> RatioCI:
    """B/A from index-paired runs: the geometric mean of the per-pair ratios, t-interval on their logs."""
    b, a = _check(candidate, "candidate values"), _check(baseline, "baseline values")
    if b.size != a.size:
        raise ValueError(f"paired values need equal counts, got {b.size} and {a.size}")
    return log_ratio_interval(list(b / a), confidence=confidence, process_noise=process_noise, restarts=restarts)


def unpaired_ratio_interval(candidate: Sequence[float], baseline: Sequence[float], *, confidence: float = 0.95,
                            process_noise: float = 0.0, restarts: int = 1) -> RatioCI:
    """B/A from two unpaired sets of runs: the ratio of geometric means, Welch's t-interval on the logs."""
    lb, la = np.log(_check(candidate, "candidate values")), np.log(_check(baseline, "baseline values"))
    centre = float(lb.mean() - la.mean())
    vb = float(lb.var(ddof=1)) / lb.size if lb.size > 1 else 0.0
    va = float(la.var(ddof=1)) / la.size if la.size > 1 else 0.0
    extra = process_noise ** 2 / max(restarts, 1)
    if vb + va + extra <= 0 or lb.size < 2 or la.size < 2:
        half = 0.0
    else:
        # Welch-Satterthwaite degrees of freedom for the runs' part; the known process term
        # in quadrature at the normal quantile, as in _t_half.
        denom = (vb * vb / (lb.size - 1) if lb.size > 1 else 0.0) + (va * va / (la.size - 1) if la.size > 1 else 0.0)
        dof = (vb + va) ** 2 / denom if denom > 0 else float(min(lb.size, la.size) - 1)
        own = t_ppf(0.5 + confidence / 2, max(dof, 1.0)) * math.sqrt(vb + va)
        half = math.hypot(own, norm_ppf(0.5 + confidence / 2) * math.sqrt(extra))
    return RatioCI(ratio=_exp(centre), low=_exp(centre - half), high=_exp(centre + half),
                   confidence=confidence, stat="geomean", n_candidate=int(lb.size), n_baseline=int(la.size),
                   paired=False, n_boot=0, process_noise=process_noise, restarts=restarts)


def t_interval_of_values(values: Sequence[float], *, confidence: float = 0.95) -> tuple[float, float, float]:
    """(geometric mean, low, high) of positive values: the absolute gates' interval (the same family)."""
    logs = np.log(_check(values, "values"))
    n = int(logs.size)
    centre = float(logs.mean())
    half = _t_half(float(logs.std(ddof=1)), n, confidence) if n > 1 else 0.0
    return _exp(centre), _exp(centre - half), _exp(centre + half)


def label(ci: RatioCI, what: str) -> str:
    """What an interval is, in words: ``95% t-interval of the geometric mean ratio over 6 interleaved pairs``."""
    conf = f"{ci.confidence:.1%}".replace(".0%", "%")
    noise = f", process noise {ci.process_noise:.2%} over {ci.restarts} restart(s)" if ci.process_noise > 0 else ""
    return f"{conf} t-interval of the geometric mean {what}{noise}"


__all__ = ["label", "log_ratio_interval", "paired_ratio_interval", "t_interval_of_values", "unpaired_ratio_interval"]
