"""The sequential design and the sample-size plan: their error rates, checked by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infra_agent.judge.sample_plan import (
    Noise,
    estimate_noise,
    noise_from_pairs,
    noise_from_windows,
    plan_sample,
)
from infra_agent.judge.sequential import (
    SequentialDesign,
    compute_pocock_constant,
    detectable_effect,
    fixed_design_pairs,
    pocock_constant,
)
from infra_agent.stats.intervals import (
    log_ratio_interval,
    paired_ratio_interval,
    unpaired_ratio_interval,
)


def test_the_tabled_pocock_constants_are_what_the_integral_gives() -> None:
    for looks in (2, 3, 4):
        assert compute_pocock_constant(looks) == pytest.approx(pocock_constant(looks), abs=2e-4)
    assert pocock_constant(1) == pytest.approx(1.95996, abs=1e-4)


def _false_positive_rate(design: SequentialDesign, trials: int, seed: int, confidence: float | None = None) -> float:
    """A/A: identical sides, per-pair log-normal noise; a look whose interval excludes 1 is a false positive."""
    rng = np.random.default_rng(seed)
    conf = confidence if confidence is not None else design.confidence
    hits = 0
    for _ in range(trials):
        ratios = np.exp(rng.normal(0.0, 0.04, design.max_pairs))
        for look in range(1, design.looks + 1):
            n = look * design.batch
            if n < 3:
                continue
            ci = log_ratio_interval(ratios[:n].tolist(), confidence=conf)
            if not ci.low <= 1.0 <= ci.high:
                hits += 1
                break
    return hits / trials


def test_looking_after_every_batch_keeps_false_positives_at_five_percent() -> None:
    design = SequentialDesign(looks=4, batch=3)
    assert design.confidence > 0.98  # each look is wider than 95% ...
    fpr = _false_positive_rate(design, 3000, seed=1)
    # ... so that over all four looks the rate is 5% (3000 trials: +-0.8% sampling error).
    assert fpr <= 0.066, fpr
    # The naive design, a 95% interval at each of the four looks, is what the plan avoids.
    naive = _false_positive_rate(design, 3000, seed=1, confidence=0.95)
    assert naive >= 0.09, naive


def test_the_planned_pairs_give_the_stated_power() -> None:
    # sd 4% per pair, a 5% minimum effect: the plan's pairs decide a change of twice the minimum
    # (supported: the interval clears 1.05) about 90% of the time at a single look.
    sd, effect = 0.04, 0.05
    n = fixed_design_pairs(sd, effect, power=0.9)
    rng = np.random.default_rng(2)
    supported = 0
    trials = 2000
    for _ in range(trials):
        ratios = np.exp(rng.normal(2 * math.log1p(effect), sd, n))
        supported += log_ratio_interval(ratios.tolist()).low >= 1 + effect
    assert 0.85 <= supported / trials <= 0.95, (n, supported / trials)
    # detectable_effect is its inverse
    assert detectable_effect(sd, n) <= effect + 1e-9 < detectable_effect(sd, n - 1)


def test_the_interval_family_pairs_runs_and_falls_back_to_welch_for_unequal_counts() -> None:
    a, b = [100.0, 102.0, 98.0, 101.0], [110.0, 112.0, 108.0, 111.0]
    paired = paired_ratio_interval(b, a)
    assert paired.paired and paired.stat == "geomean" and paired.low < paired.ratio < paired.high
    assert paired.ratio == pytest.approx(math.exp(np.mean(np.log(np.array(b) / np.array(a)))))
    unpaired = unpaired_ratio_interval(b[:3], a)
    assert not unpaired.paired and unpaired.low < unpaired.ratio < unpaired.high
    widened = paired_ratio_interval(b, a, process_noise=0.02, restarts=1)
    assert widened.high - widened.low > paired.high - paired.low
    with pytest.raises(ValueError, match="positive"):
        log_ratio_interval([1.0, 0.0])


def test_noise_comes_from_the_baseline_windows_and_the_judged_pairs() -> None:
    windows = noise_from_windows([100.0, 104.0, 96.0])
    assert windows is not None and windows.df == 2 and windows.sd == pytest.approx(
        float(np.std(np.log([100.0, 104.0, 96.0]), ddof=1)) * math.sqrt(2))
    pairs = noise_from_pairs([[0.01, -0.01, 0.0], [0.1, 0.12]])  # each around its own mean
    assert pairs is not None and pairs.df == 3 and pairs.sd < 0.02
    both = estimate_noise(windows, pairs)
    assert both is not None and both.df == 5 and pairs.sd < both.sd < windows.sd
    assert noise_from_windows([100.0]) is None and estimate_noise(None, None) is None


def test_a_plan_that_the_cap_cannot_meet_says_so_and_what_would_help() -> None:
    quiet = plan_sample("output_throughput", 0.05, Noise(0.02, 10, "test"), batch=3, max_pairs=12)
    assert quiet.feasible and quiet.design.looks == 2 and quiet.needed is not None and quiet.needed <= 6
    assert "needs ~" in quiet.text() and "up to 2 looks of 3 pairs" in quiet.text()
    loud = plan_sample("output_throughput", 0.05, Noise(0.15, 10, "test"), batch=3, max_pairs=12)
    assert not loud.feasible and loud.design.looks == 4 and loud.detectable is not None and loud.detectable > 0.15
    text = loud.text()
    assert "more than the cap of 12" in text and f"detect only a change of {loud.detectable:.1%}" in text
    assert "longer windows" in text and f"--max-pairs {loud.needed}" in text and "larger minimum effect" in text
    fixed = plan_sample("output_throughput", 0.05, Noise(0.02, 10, "test"), batch=3, max_pairs=12, sequential=False)
    assert fixed.design.looks == 1 and fixed.design.confidence == pytest.approx(0.95)
    unknown = plan_sample("kv_ratio", 0.05, None, batch=3, max_pairs=6)
    assert unknown.needed is None and "not known yet" in unknown.text()
