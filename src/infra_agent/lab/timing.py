"""Timing one callable: CPU wall clock or GPU events, with a confidence interval.

- CPU: warm-up calls, then ``time.perf_counter_ns`` samples.  Calls shorter than
  ``min_sample_ns`` are batched so the clock's resolution and call overhead do not
  dominate a sample; the sample is the per-call average of its batch.
- GPU (``time_cuda``): the device is synchronised before timing and every rep starts
  by zeroing a buffer twice the size of L2, so each rep starts cold.  Methods:

  - ``cuda_events_delayed`` (the default): after the flush, a GPU-side spin
    (``torch.cuda._sleep``) sized to ~2.5x the host's time for one call, then the
    start event, ``fn()``, the end event.  While the GPU spins, the host finishes
    enqueueing ``fn``'s kernels, so the events bracket GPU time only.  Without the
    spin they bracket the host's launch cost too: a small Triton kernel called from
    Python with ~40 arguments read 130 µs for 17 µs of GPU work on an H200.
  - ``cuda_graph``: ``fn`` captured once in a CUDA graph and replayed (after the
    same spin); a callable that cannot be captured falls back to the above, noted.
  - ``cuda_events``: events right after the flush, launch cost included (the old way).
  - ``do_bench``: ``triton.testing.do_bench`` (which flushes L2 the same way).

  Beside the GPU time, every GPU method reports ``host_s``: the host's time per call,
  from a burst of back-to-back calls without a sync.  When it exceeds the GPU time
  the kernel is launch-bound: run back to back, calls go at the host's pace.

The interval is a bootstrap CI of the median: timings are skewed (a tail of
preempted reps), and a t-interval of the mean would be pulled by the tail.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

Method = Literal["perf_counter_ns", "cuda_events", "cuda_events_delayed", "cuda_graph", "do_bench"]
GPU_DEFAULT: Method = "cuda_events_delayed"

# The GPU-side delay before each rep's start event: this many times the host's time
# for one call, within these bounds.  The floor covers a fast host's jitter; the cap
# keeps a slow wrapper from stalling the run (its note then says the launch may show).
DELAY_FACTOR = 2.5
MIN_DELAY_US = 20.0
MAX_DELAY_US = 5000.0


@dataclass
class Timing:
    """Per-call seconds: samples, median and the 95% bootstrap CI of the median.

    On a GPU, ``median_s`` and the CI are GPU time; ``host_*`` is the host's time per
    call (Python plus launch), None on the CPU, where the two are the same thing.
    """

    samples_s: list[float]
    median_s: float
    ci_low_s: float
    ci_high_s: float
    method: Method
    warmup: int
    batch: int = 1
    notes: list[str] = field(default_factory=list)
    host_samples_s: list[float] | None = None
    host_median_s: float | None = None
    host_ci_low_s: float | None = None
    host_ci_high_s: float | None = None

    @property
    def best_s(self) -> float:
        """The fastest sample: what the machine can do, used for ceilings."""
        return min(self.samples_s)

    @property
    def launch_ratio(self) -> float | None:
        """Host time per call over GPU time per call; > 1 means launch-bound."""
        if self.host_median_s is None or self.median_s <= 0:
            return None
        return self.host_median_s / self.median_s

    def to_dict(self) -> dict[str, Any]:
        host = None
        if self.host_median_s is not None:
            host = {"median_s": self.host_median_s, "ci_low_s": self.host_ci_low_s, "ci_high_s": self.host_ci_high_s,
                    "n": len(self.host_samples_s or [])}
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
            "host_s": host,
            "launch_ratio": self.launch_ratio,
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


def with_host(t: Timing, host_samples: list[float]) -> Timing:
    """``t`` with the host's per-call samples, their median and its CI."""
    t.host_samples_s = host_samples
    t.host_median_s = float(np.median(host_samples))
    t.host_ci_low_s, t.host_ci_high_s = bootstrap_median_ci(host_samples)
    return t


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


def delay_us_for(host_call_s: float, factor: float = DELAY_FACTOR, min_us: float = MIN_DELAY_US, max_us: float = MAX_DELAY_US) -> float:
    """Microseconds of GPU spin that hide a host call of ``host_call_s`` seconds."""
    return min(max(factor * host_call_s * 1e6, min_us), max_us)


def cycles_for(delay_us: float, cycles_per_us: float) -> int:
    """``torch.cuda._sleep`` cycles for ``delay_us`` at the measured clock (at least 1)."""
    return max(1, math.ceil(delay_us * cycles_per_us))


def host_burst(fn: Callable[[], Any], n: int) -> list[float]:
    """Seconds per call of ``n`` back-to-back calls, no sync: what the host spends.

    The caller synchronises first; the burst is short enough (tens of calls) not to
    fill the launch queue, which would make the host wait on the GPU.
    """
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def sleep_cycles_per_us(probe_cycles: int = 1_000_000) -> float:
    """Clock cycles per µs of the spin kernel (~0.5 ms at full clock), timed once with events.

    A shorter spin queued first gives the host time to enqueue the timed one and its
    end event, so the events measure the spin, not its launch (on the H200 a 10k-cycle
    spin read 50 µs for 5 µs of spinning when timed without it).
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe_cycles // 4)
    start.record()
    torch.cuda._sleep(probe_cycles)
    end.record()
    end.synchronize()
    return probe_cycles / max(start.elapsed_time(end) * 1e3, 1e-3)


def record_cost_s(n: int = 20) -> float:
    """Host seconds to record one CUDA event (median of ``n``)."""
    ev = torch.cuda.Event(enable_timing=True)
    out: list[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        ev.record()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def _capture(fn: Callable[[], Any]) -> Callable[[], Any] | str:
    """``fn`` captured in a CUDA graph (its replay), or why it was not captured.

    A capture that fails part-way leaves torch's CUDA RNG in capture mode for the rest
    of the process (seen with torch 2.11: every later ``randn`` on the device raises),
    so the usual cause, a call that synchronises with the host (``.item()``, a copy
    to the CPU), is caught first by one call under sync debug mode, not by capturing.
    """
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # "a prototype feature": said once here, not per entry
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a host sync, or fn's own error (the timing loop raises it again)
        return f"it synchronises with the host ({_first_line(exc)})"
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return graph.replay
    except Exception as exc:  # noqa: BLE001 - an operation capture does not allow
        torch.cuda.synchronize()
        return f"{_first_line(exc)}; torch's CUDA RNG may be unusable in this process after a failed capture"


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def time_cuda(
    fn: Callable[[], Any],
    device: torch.device | str = "cuda",
    warmup: int = 10,
    reps: int = 50,
    method: Method = GPU_DEFAULT,
) -> Timing:
    """GPU time of ``fn()`` per call, each rep starting with a cold L2, and host time per call."""
    assert torch.cuda.is_available(), "time_cuda needs a CUDA device"
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    host = host_burst(fn, max(10, min(reps, 50)))
    torch.cuda.synchronize(device)
    if method == "do_bench":
        import triton.testing  # only on GPU machines; keeps triton off the import path

        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
        t = _summarise([m / 1e3 for m in ms], "do_bench", warmup=25, notes=["triton.testing.do_bench, L2 flushed; its events include the launch cost"])
        return with_host(t, host)

    flush = l2_flush_buffer(device)
    notes = [f"L2 flushed with a {flush.numel() >> 20} MiB buffer"]
    launch, cycles, delay = fn, 0, 0.0
    if method == "cuda_graph":
        replay = _capture(fn)
        if isinstance(replay, str):
            notes.append(f"not capturable in a CUDA graph ({replay}); timed with cuda_events_delayed")
            method = "cuda_events_delayed"
        else:
            launch = replay
            notes.append("captured once in a CUDA graph, replayed per rep")
    if method in ("cuda_events_delayed", "cuda_graph"):
        # The spin must outlast the host's work for one rep: the call (jitter included)
        # and the two event records around it, which cost several µs each on a VM.
        slow = float(np.quantile(host, 0.9))
        records = 2 * record_cost_s()
        delay = delay_us_for(slow + records)
        rate = sleep_cycles_per_us()
        cycles = cycles_for(delay, rate)
        notes.append(f"launch hidden: {delay:.0f} µs GPU spin before each start event ({cycles} cycles at {rate:.0f}/µs); "
                     f"host call p90 {slow * 1e6:.1f} µs + event records {records * 1e6:.1f} µs")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    late = 0
    for i in range(reps):
        flush.zero_()
        if cycles:
            torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        starts[i].record()
        launch()
        ends[i].record()
        # A call that outlasts the spin lets the GPU reach the start event early.
        if cycles and (time.perf_counter() - t0) * 1e6 > delay:
            late += 1
    torch.cuda.synchronize(device)
    if late:
        notes.append(f"{late}/{reps} reps took the host longer than the spin: their GPU time may include launch cost")
    samples = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    return with_host(_summarise(samples, method, warmup, notes=notes), host)


def time_call(fn: Callable[[], Any], device: str, budget_s: float = 0.5, method: Method | None = None) -> Timing:
    """Dispatch on the device: events (launch hidden) on CUDA, wall clock on the CPU."""
    if device.startswith("cuda"):
        return time_cuda(fn, device=device, method=method or GPU_DEFAULT)
    return time_cpu(fn, budget_s=budget_s)
