from __future__ import annotations

import math
import time

import pytest

from infra_agent.kernels.roofline import Ceilings, classify, measure_ceilings, merge
from infra_agent.kernels.timing import bootstrap_median_ci, time_cpu

# A synthetic machine: 1 TB/s and 100 TFLOP/s -> ridge at 100 FLOP/byte.
BW, FL = 1e12, 100e12


def test_memory_bound_below_ridge() -> None:
    # 1 GB moved and 10 GFLOP in 2 ms: intensity 10 < 100; 0.5 TB/s is half the ceiling.
    p = classify(flops=10e9, nbytes=1e9, seconds=2e-3, bandwidth_Bps=BW, compute_flops_per_s=FL)
    assert p.bound == "memory" and p.ridge == pytest.approx(100.0) and p.intensity == pytest.approx(10.0)
    assert p.achieved_Bps == pytest.approx(0.5e12) and p.fraction == pytest.approx(0.5) and p.headroom == pytest.approx(0.5)


def test_compute_bound_above_ridge() -> None:
    # 1 TFLOP over 1 GB (intensity 1000) in 20 ms: 50 TFLOP/s = 50% of compute.
    p = classify(flops=1e12, nbytes=1e9, seconds=20e-3, bandwidth_Bps=BW, compute_flops_per_s=FL)
    assert p.bound == "compute" and p.fraction == pytest.approx(0.5)
    assert p.achieved_flops_per_s == pytest.approx(50e12)


def test_kda_anchor_numbers_classify_as_memory_bound() -> None:
    # ANCHORS: N=128 decode, shipped BV=32, 169 us at 3.21 TB/s against a 4.25 TB/s copy.
    nbytes = 3.21e12 * 169e-6
    p = classify(flops=None, nbytes=nbytes, seconds=169e-6, bandwidth_Bps=4.25e12, compute_flops_per_s=None)
    assert p.bound == "memory" and p.fraction == pytest.approx(3.21 / 4.25) and p.headroom == pytest.approx(1 - 3.21 / 4.25)


def test_unknown_without_counts() -> None:
    p = classify(flops=None, nbytes=None, seconds=1.0, bandwidth_Bps=BW, compute_flops_per_s=FL)
    assert p.bound == "unknown" and p.fraction is None


def test_merge_keeps_the_better_ceiling() -> None:
    a = Ceilings("cpu", 10e9, {"fp32": 50e9})
    b = Ceilings("cpu", 12e9, {"fp32": 40e9, "bf16": 60e9})
    m = merge(a, b)
    assert m.bandwidth_Bps == 12e9 and m.flops_per_s == {"fp32": 50e9, "bf16": 60e9}


def test_real_cpu_ceilings_small() -> None:
    c = measure_ceilings("cpu", ("fp32", "tf32"), copy_bytes=4 * 2**20, matmul_n=128, budget_s=0.05)
    assert math.isfinite(c.bandwidth_Bps) and c.bandwidth_Bps > 1e8  # any machine copies >100 MB/s
    assert c.flops_per_s["fp32"] > 1e8
    assert c.flops_per_s["tf32"] == c.flops_per_s["fp32"]  # emulated on the CPU
    assert c.timings["copy"]["n"] >= 10


def test_bootstrap_ci_brackets_median() -> None:
    samples = [1.0, 1.1, 0.9, 1.05, 0.95, 5.0, 1.02, 0.98, 1.01, 0.99]
    lo, hi = bootstrap_median_ci(samples)
    assert lo <= 1.005 <= hi and hi < 5.0  # the outlier does not drag the median's CI
    assert bootstrap_median_ci([2.0]) == (2.0, 2.0)


def test_time_cpu_measures_a_known_sleep() -> None:
    t = time_cpu(lambda: time.sleep(0.002), warmup=1, min_samples=5, max_samples=5, budget_s=0.0)
    assert len(t.samples_s) == 5 and t.batch == 1
    assert 0.002 <= t.median_s < 0.05 and t.ci_low_s <= t.median_s <= t.ci_high_s
    fast = time_cpu(lambda: None, warmup=1, min_samples=5, max_samples=5, budget_s=0.0)
    assert fast.batch > 1  # sub-microsecond calls are batched per sample
