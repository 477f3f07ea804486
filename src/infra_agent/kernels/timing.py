"""Timing one callable: CPU wall clock or GPU events, with a confidence interval.

- CPU: warm-up calls, then ``time.perf_counter_ns`` samples.  Calls shorter than
  ``min_sample_ns`` are batched so the clock's resolution and call overhead do not
  dominate a sample; the sample is the per-call average of its batch.
- GPU: the device is synchronised before timing; every rep is preceded by zeroing a
  buffer twice the size of L2 so each rep starts cold, and only the kernel sits
  between the CUDA events.  ``method="do_bench"`` uses ``triton.testing.do_bench``
  (which flushes L2 the same way) instead.

The interval is a bootstrap CI of the median: kernel timings are skewed (a long
tail of preempted reps), so the median is the headline and a t-interval of the mean
would be pulled by the tail.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

Method = Literal["perf_counter_ns", "cuda_events", "do_bench"]


@dataclass
class Timing:
    """Per-call seconds: samples, median and the 95% bootstrap CI of the median."""

    samples_s: list[float]
    median_s: float
    ci_low_s: float
    ci_high_s: float
    method: Method
    warmup: int
    batch: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def best_s(self) -> float:
        """The fastest sample: what the machine can do, used for ceilings."""
        return min(self.samples_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median_s,
            "best_s": self.best_s,
            "ci_low_s": self.ci_low_s,
            "ci_high_s": self.ci_high_s,
            "n": len(self.samples_s),
            "method": self.method,
            "warmup": self.warmup,
            "batch": self.batch,
            "notes": self.notes,
        }


def bootstrap_median_ci(samples: list[float], confidence: float = 0.95, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap CI of the median; degenerate (median, median) for n < 2."""
    arr = np.asarray(samples, dtype=np.float64)
    med = float(np.median(arr))
    if arr.size < 2:
        return med, med
    # A fixed seed: the CI of the same samples should not wobble between calls.
    rng = np.random.default_rng(seed)
    boots = np.median(rng.choice(arr, size=(n_boot, arr.size), replace=True), axis=1)
    alpha = (1.0 - confidence) / 2.0
    return float(np.quantile(boots, alpha)), float(np.quantile(boots, 1.0 - alpha))


def _summarise(samples: list[float], method: Method, warmup: int, batch: int = 1, notes: list[str] | None = None) -> Timing:
    lo, hi = bootstrap_median_ci(samples)
    return Timing(samples, float(np.median(samples)), lo, hi, method, warmup, batch, notes or [])


def time_cpu(
    fn: Callable[[], Any],
    warmup: int = 3,
    min_samples: int = 10,
    max_samples: int = 200,
    budget_s: float = 0.5,
    min_sample_ns: int = 200_000,
) -> Timing:
    """Wall-clock samples of ``fn()`` until ``budget_s`` is spent (at least ``min_samples``)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter_ns()
    fn()
    one = max(time.perf_counter_ns() - t0, 1)
    batch = max(1, math.ceil(min_sample_ns / one))
    samples: list[float] = []
    deadline = time.perf_counter_ns() + int(budget_s * 1e9)
    while len(samples) < max_samples and (len(samples) < min_samples or time.perf_counter_ns() < deadline):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - start) / batch / 1e9)
    return _summarise(samples, "perf_counter_ns", warmup, batch)


def l2_flush_buffer(device: torch.device | str) -> torch.Tensor:
    """A byte buffer twice the device's L2, zeroed between reps to evict the kernel's data."""
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    # Older torch builds lack L2_cache_size; 256 MiB exceeds every current L2.
    l2 = int(getattr(props, "L2_cache_size", 0) or 128 * 2**20)
    return torch.empty(2 * l2, dtype=torch.uint8, device=dev)


def time_cuda(
    fn: Callable[[], Any],
    device: torch.device | str = "cuda",
    warmup: int = 10,
    reps: int = 50,
    method: Method = "cuda_events",
) -> Timing:
    """GPU time of ``fn()`` per call, each rep starting with a cold L2."""
    assert torch.cuda.is_available(), "time_cuda needs a CUDA device"
    if method == "do_bench":
        import triton.testing  # only on GPU machines; keeps triton off the import path

        fn()
        torch.cuda.synchronize(device)
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
        return _summarise([m / 1e3 for m in ms], "do_bench", warmup=25, notes=["triton.testing.do_bench, L2 flushed"])

    flush = l2_flush_buffer(device)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    return _summarise(samples, "cuda_events", warmup, notes=[f"L2 flushed with a {flush.numel() >> 20} MiB buffer"])


def time_call(fn: Callable[[], Any], device: str, budget_s: float = 0.5, method: Method | None = None) -> Timing:
    """Dispatch on the device: events on CUDA, wall clock on the CPU."""
    if device.startswith("cuda"):
        return time_cuda(fn, device=device, method=method or "cuda_events")
    return time_cpu(fn, budget_s=budget_s)
