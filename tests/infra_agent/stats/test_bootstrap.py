from __future__ import annotations

import numpy as np
import pytest

from infra_agent.stats.bootstrap import bootstrap_ratio, expanded_alpha


def test_ratio_ci_covers_the_true_ratio_of_medians() -> None:
    # Lognormal latencies; candidate is 1.10x the baseline, so the true ratio of
    # medians is exactly 1.10.  A 95% interval must cover it in ~95% of repetitions.
    rng = np.random.default_rng(0)
    reps, hits = 200, 0
    for k in range(reps):
        base = rng.lognormal(0.0, 0.4, size=60)
        cand = 1.10 * rng.lognormal(0.0, 0.4, size=60)
        ci = bootstrap_ratio(cand, base, stat="median", n_boot=400, seed=k)
        hits += ci.low <= 1.10 <= ci.high
    # 200 reps at p=0.95: binomial sd ~1.5%; 0.90 is > 3 sd below nominal.
    assert hits / reps >= 0.90


def test_paired_small_sample_coverage_and_drift_cancelling() -> None:
    # Six interleaved pairs of run-level throughput with a strong shared drift: a
    # paired interval must still cover the true 0.95 ratio and stay narrow.
    rng = np.random.default_rng(1)
    reps, hits, widths = 300, 0, []
    for k in range(reps):
        drift = rng.normal(100.0, 15.0, size=6)  # the machine's mood per pair
        base = drift * rng.normal(1.0, 0.02, size=6)
        cand = 0.95 * drift * rng.normal(1.0, 0.02, size=6)
        ci = bootstrap_ratio(cand, base, stat="mean", paired=True, n_boot=400, seed=k)
        hits += ci.low <= 0.95 <= ci.high
        widths.append(ci.high - ci.low)
    assert hits / reps >= 0.90
    assert float(np.median(widths)) < 0.06  # unpaired, the 15% drift would swamp a 5% effect


def test_seeded_and_expanded_alpha() -> None:
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 2.5, 3.5, 5.0]
    assert bootstrap_ratio(a, b, seed=3) == bootstrap_ratio(a, b, seed=3)
    assert expanded_alpha(5, 0.95) < expanded_alpha(20, 0.95) < 0.05  # fewer samples, wider interval
    assert expanded_alpha(10_000, 0.95) == pytest.approx(0.05, rel=0.01)
    with pytest.raises(ValueError):
        bootstrap_ratio([1.0, 2.0], [1.0], paired=True)
    p99 = bootstrap_ratio(np.arange(1, 101), np.arange(1, 101), stat="p99", n_boot=200)
    assert p99.ratio == pytest.approx(1.0)


def _aa_comparison(rng: np.random.Generator, tau: float, restarts: int, pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """A/A throughput runs where every fresh process carries its own offset (sd tau/sqrt2
    per process, so the A-vs-B log offset per restart has sd tau), plus per-run noise."""
    restart_of = np.arange(pairs) * restarts // pairs
    off_a = rng.normal(0.0, tau / np.sqrt(2), size=restarts)[restart_of]
    off_b = rng.normal(0.0, tau / np.sqrt(2), size=restarts)[restart_of]
    base = 100.0 * np.exp(off_a + rng.normal(0.0, 0.05, size=pairs))
    cand = 100.0 * np.exp(off_b + rng.normal(0.0, 0.05, size=pairs))
    return cand, base


@pytest.mark.parametrize("restarts", [1, 3])
def test_process_noise_restores_coverage_across_fresh_processes(restarts: int) -> None:
    # Per-run noise 5% over 60 pairs gives a run-only interval of about +-1.3%; a 2%
    # process offset is invisible to it, so A/A intervals miss 1 far too often.  With
    # the offset's spread passed in, the interval holds its 95% again.
    rng = np.random.default_rng(7 + restarts)
    reps, tau = 300, 0.02
    miss_runs_only = miss_with_noise = 0
    for k in range(reps):
        cand, base = _aa_comparison(rng, tau, restarts, pairs=60)
        plain = bootstrap_ratio(cand, base, stat="mean", paired=True, n_boot=400, seed=k)
        wide = bootstrap_ratio(cand, base, stat="mean", paired=True, n_boot=400, seed=k, process_noise=tau, restarts=restarts)
        miss_runs_only += not plain.low <= 1.0 <= plain.high
        miss_with_noise += not wide.low <= 1.0 <= wide.high
        assert wide.high - wide.low > plain.high - plain.low
    # 300 reps at a true 5% miss rate: binomial sd ~1.3%; 0.09 is > 3 sd above it.
    assert miss_with_noise / reps <= 0.09
    assert miss_runs_only / reps >= 0.15  # without the term the interval is badly overconfident


def test_process_noise_validation() -> None:
    with pytest.raises(ValueError, match="process_noise"):
        bootstrap_ratio([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], process_noise=-0.1)
    with pytest.raises(ValueError, match="restarts"):
        bootstrap_ratio([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], restarts=0)
