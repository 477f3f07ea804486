from __future__ import annotations

import math
import time

import pytest

from infra_agent.lab.roofline import Ceilings, classify, measure_ceilings, merge
from infra_agent.lab.timing import bootstrap_median_ci, time_cpu

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


def test_copy_of_the_same_bytes_splits_the_headroom() -> None:
    # The H200 figures of refstack's fused KDA step at N=128 (docs/performance.md): 542.1 MB in
    # 144.2 µs against a 4.237 TB/s ceiling, and a copy of the same bytes in 129.9 µs.
    nbytes, ceiling = 542.1e6, 4.237e12
    p = classify(None, nbytes, 144.2e-6, ceiling, None, copy_same_bytes_s=129.9e-6)
    assert p.bound == "memory" and p.fraction == pytest.approx(nbytes / 144.2e-6 / ceiling)
    assert p.vs_copy_same_bytes == pytest.approx(129.9 / 144.2)
    assert p.copy_fraction == pytest.approx(nbytes / 129.9e-6 / ceiling)
    d = p.to_dict()
    assert d["copy_same_bytes_s"] == 129.9e-6 and d["vs_copy_same_bytes"] == pytest.approx(129.9 / 144.2)
    # A compute-bound point carries no copy: bytes are not what bounds it.
    q = classify(1e12, 1e9, 20e-3, BW, FL, copy_same_bytes_s=1e-3)
    assert q.bound == "compute" and q.copy_same_bytes_s is None and q.vs_copy_same_bytes is None and q.copy_fraction is None


def _finding(seconds: float, copy_s: float):  # type: ignore[no-untyped-def]
    from infra_agent.feedback import Location
    from infra_agent.lab.findings import roofline_finding
    from infra_agent.lab.microbench import BenchEntry
    from infra_agent.lab.timing import Timing

    nbytes = 542.1e6
    e = BenchEntry("fused", "fp32", "N=128", "bfloat16", "timed", bytes=nbytes,
                   timing=Timing(samples_s=[seconds] * 5, method="cuda_events_delayed", warmup=1, median_s=seconds,
                                 ci_low_s=seconds, ci_high_s=seconds))
    rl = classify(None, nbytes, seconds, 4.237e12, None, copy_same_bytes_s=copy_s)
    return roofline_finding(e, rl, Location(kernel="kda"))


def test_roofline_finding_names_the_kernels_own_share_and_the_floor() -> None:
    f = _finding(144.2e-6, 129.9e-6)
    own, floor = 1 - 129.9 / 144.2, 1 - (542.1e6 / 4.237e12) / 144.2e-6 - (1 - 129.9 / 144.2)
    assert f.evidence["own_share"] == pytest.approx(own) and f.evidence["floor_share"] == pytest.approx(floor)
    assert f.evidence["own_share"] + f.evidence["floor_share"] == pytest.approx(f.evidence["headroom"])
    assert f"{own:.1%} of the kernel's time is its own" in f.message and "129.9 µs" in f.message
    assert "holds the kernel back" in f.next_question  # 90% of a copy: the kernel's own share is what to chase
    # Within 3% of the copy: what is left is the size's floor, and the question turns to launches.
    near = _finding(131.0e-6, 129.9e-6)
    assert "the size's floor" in near.next_question and "CUDA graph" in near.next_question
    assert "within 0.8% of a plain copy" in near.next_question
    # Faster than the copy (small sizes on a GPU: refstack's N=8 step beat torch's copy of its bytes).
    ahead = _finding(14.0e-6, 14.94e-6)
    assert ahead.evidence["own_share"] == 0.0 and "6.7% faster than a plain copy" in ahead.next_question
    # A copy timed above the ceiling (the docs' N=512 row: 100.2%): the split still adds up to the
    # headroom, the kernel's own share capped at it and the floor at zero.
    above = _finding(600e-6, 542.1e6 / 4.237e12 * 0.99)
    assert above.evidence["own_share"] == pytest.approx(above.evidence["headroom"])
    assert above.evidence["floor_share"] == 0.0


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
