"""Roofline from ceilings measured in the same process, on the same device.

Datasheet peaks are not what a kernel can reach on this machine today (clocks, power,
the CPU's thread count, a neighbour on the host), so the ceilings are measured, from
the *fastest* sample (a ceiling is what the machine can do; noise only slows it):

- bandwidth: one large tensor copy, counting bytes read plus bytes written;
- compute: a matmul big enough to saturate the units, per precision mode (on CUDA
  fp32 with TF32 off, fp32 with TF32 on, bf16/fp16 operands; on the CPU every mode is
  an fp32 matmul, because TF32 and 3xTF32 are emulated there).

A kernel is memory-bound when its arithmetic intensity (FLOP/byte) sits left of the
ridge point (compute ceiling / bandwidth ceiling); the achieved fraction of the
ceiling that binds it, and the headroom (1 - fraction), are what the agent acts on.

The bandwidth ceiling is a copy large enough that its fixed costs vanish.  A kernel of
a given size pays them anyway: the launch in the timing's events, filling the memory
pipeline and draining it.  So a memory-bound entry also gets a *copy of its own bytes*
(``copy_same_bytes``: half read, half written), timed the same way right after it.  Its
time is what a kernel moving those bytes in equal reads and writes can reach in this
timing, and it splits the headroom in two: the part a copy pays too (the size's floor)
and the kernel's own (its access pattern, dependent loads, occupancy), which is the part
a change to the kernel can win back.  A kernel that mostly reads can beat a copy of its
bytes (reads stream faster than read-write pairs), so its own share reads low.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from infra_agent.lab.timing import Method, Timing, time_call

Bound = Literal["memory", "compute", "unknown"]


@dataclass
class Ceilings:
    device: str
    bandwidth_Bps: float
    # Precision mode -> FLOP/s of the measured matmul.
    flops_per_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def compute(self, precision: str) -> float | None:
        return self.flops_per_s.get(precision)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "bandwidth_GBps": self.bandwidth_Bps / 1e9,
            "gflops_per_s": {k: v / 1e9 for k, v in self.flops_per_s.items()},
            "notes": self.notes,
            "timings": self.timings,
        }


@dataclass
class RooflinePoint:
    intensity: float | None  # FLOP per byte
    ridge: float | None  # FLOP per byte where the two ceilings meet
    bound: Bound
    achieved_Bps: float | None
    achieved_flops_per_s: float | None
    fraction: float | None  # of the ceiling that binds
    headroom: float | None  # 1 - fraction
    kernel_s: float = 0.0  # the timed median the point was placed from
    # A plain copy of the same bytes, timed the same way (memory-bound entries; None if not measured).
    copy_same_bytes_s: float | None = None

    @property
    def vs_copy_same_bytes(self) -> float | None:
        """The copy's time over the kernel's: 1.0 is as fast as moving these bytes gets at this size."""
        if self.copy_same_bytes_s is None or not self.kernel_s:
            return None
        return self.copy_same_bytes_s / self.kernel_s

    @property
    def copy_fraction(self) -> float | None:
        """The same-bytes copy's fraction of the bandwidth ceiling (both move the same bytes)."""
        ratio = self.vs_copy_same_bytes
        if not ratio or self.fraction is None or self.bound != "memory":
            return None
        return self.fraction / ratio

    def to_dict(self) -> dict[str, Any]:
        return {
            "intensity": self.intensity,
            "ridge": self.ridge,
            "bound": self.bound,
            "achieved_GBps": None if self.achieved_Bps is None else self.achieved_Bps / 1e9,
            "achieved_GFLOPps": None if self.achieved_flops_per_s is None else self.achieved_flops_per_s / 1e9,
            "fraction": self.fraction,
            "headroom": self.headroom,
            "copy_same_bytes_s": self.copy_same_bytes_s,
            "copy_same_bytes_fraction": self.copy_fraction,
            "vs_copy_same_bytes": self.vs_copy_same_bytes,
        }


def merge(first: Ceilings, second: Ceilings) -> Ceilings:
    """Ceilings measured before and after the kernels: keep the higher of each.

    On a shared machine a neighbour can slow one measurement; the kernels ran between
    the two, so the better one is the fairer bound for them.
    """
    assert first.device == second.device
    merged = Ceilings(first.device, max(first.bandwidth_Bps, second.bandwidth_Bps))
    for p in first.flops_per_s.keys() | second.flops_per_s.keys():
        merged.flops_per_s[p] = max(first.flops_per_s.get(p, 0.0), second.flops_per_s.get(p, 0.0))
    merged.notes = [f"before: {n}" for n in first.notes] + [f"after: {n}" for n in second.notes]
    merged.timings = {**{f"before_{k}": v for k, v in first.timings.items()}, **{f"after_{k}": v for k, v in second.timings.items()}}
    return merged


def classify(flops: float | None, nbytes: float | None, seconds: float, bandwidth_Bps: float, compute_flops_per_s: float | None,
             copy_same_bytes_s: float | None = None) -> RooflinePoint:
    """Place one timed call on the roofline (``copy_same_bytes_s``: see ``time_copy_of``).

    With only bytes declared the kernel is judged against bandwidth alone (a copy or
    a decode step); with only FLOPs, against compute alone.
    """
    p = _place(flops, nbytes, seconds, bandwidth_Bps, compute_flops_per_s)
    p.kernel_s = seconds
    if p.bound == "memory":
        p.copy_same_bytes_s = copy_same_bytes_s
    return p


def _place(flops: float | None, nbytes: float | None, seconds: float, bandwidth_Bps: float, compute_flops_per_s: float | None) -> RooflinePoint:
    assert seconds > 0, "a timed call takes positive time"
    bw = nbytes / seconds if nbytes else None
    fl = flops / seconds if flops else None
    if nbytes and flops and compute_flops_per_s:
        intensity = flops / nbytes
        ridge = compute_flops_per_s / bandwidth_Bps
        if intensity < ridge:
            frac = bw / bandwidth_Bps  # type: ignore[operator]
            return RooflinePoint(intensity, ridge, "memory", bw, fl, frac, 1.0 - frac)
        frac = fl / compute_flops_per_s  # type: ignore[operator]
        return RooflinePoint(intensity, ridge, "compute", bw, fl, frac, 1.0 - frac)
    if nbytes:
        frac = bw / bandwidth_Bps  # type: ignore[operator]
        return RooflinePoint(None, None, "memory", bw, fl, frac, 1.0 - frac)
    if flops and compute_flops_per_s:
        frac = fl / compute_flops_per_s  # type: ignore[operator]
        return RooflinePoint(None, None, "compute", bw, fl, frac, 1.0 - frac)
    return RooflinePoint(None, None, "unknown", bw, fl, None, None)


def measure_bandwidth(device: str, nbytes: int, budget_s: float = 0.3) -> tuple[float, Timing]:
    """Bytes/s of ``dst.copy_(src)`` with ``src`` of ``nbytes``, counting the read and the write."""
    t = time_copy_of(device, 2 * nbytes, budget_s)
    return 2.0 * max(nbytes // 4, 1) * 4 / t.best_s, t


def time_copy_of(device: str, nbytes: float, budget_s: float = 0.3, method: Method | None = None) -> Timing:
    """A copy moving ``nbytes`` (``nbytes / 2`` read, as many written), timed as the kernels are."""
    n = max(int(nbytes) // 8, 1)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return time_call(lambda: dst.copy_(src), device, budget_s=budget_s, method=method)


_MATMUL_DTYPE = {"fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul(device: str, precision: str, n: int, budget_s: float = 0.3) -> tuple[float, Timing, str]:
    """FLOP/s of an n x n x n matmul in ``precision``; returns (rate, timing, what ran)."""
    on_cuda = device.startswith("cuda")
    dtype = _MATMUL_DTYPE.get(precision, torch.float32)
    if not on_cuda and dtype in (torch.bfloat16, torch.float16):
        # CPU kernels emulate these modes with fp32 arithmetic on rounded operands.
        dtype = torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    what = f"torch.matmul {n}x{n}x{n} {str(dtype).replace('torch.', '')}"
    if on_cuda:
        tf32 = precision in ("tf32", "3xtf32")
        # The public switch ("high" allows TF32 in fp32 matmuls), stable across torch
        # versions; restored so the kernels under test run with the caller's setting.
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        try:
            t = time_call(lambda: torch.matmul(a, b, out=out), device)
        finally:
            torch.set_float32_matmul_precision(prev)
        what = f"cuBLAS {what}" + (" tf32" if tf32 else "")
    else:
        t = time_call(lambda: torch.matmul(a, b, out=out), device, budget_s=budget_s)
    return 2.0 * n**3 / t.best_s, t, what


def measure_ceilings(
    device: str,
    precisions: Sequence[str] = ("fp32",),
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    budget_s: float = 0.3,
) -> Ceilings:
    """Copy bandwidth and matmul rate(s) on ``device``, measured now."""
    on_cuda = device.startswith("cuda")
    # The copy must not fit in the last-level cache: 1 GiB on a GPU (L2 is tens of
    # MiB), 256 MiB on a CPU.  Tests pass smaller sizes and accept a cached ceiling.
    nbytes = copy_bytes or (2**30 if on_cuda else 2**28)
    n = matmul_n or (8192 if on_cuda else 1024)
    bw, bw_t = measure_bandwidth(device, nbytes, budget_s)
    ceilings = Ceilings(device=device, bandwidth_Bps=bw)
    ceilings.timings["copy"] = {"bytes": nbytes, **bw_t.to_dict()}
    ceilings.notes.append(f"copy {nbytes >> 20} MiB: {bw / 1e9:.1f} GB/s (read+write)")
    order = sorted(dict.fromkeys(precisions), key=lambda p: p != "fp32")  # fp32 first, for reuse
    for p in order:
        if not on_cuda and p in ("tf32", "3xtf32") and "fp32" in ceilings.flops_per_s:
            # Emulated on the CPU with fp32 arithmetic: the fp32 ceiling is theirs too.
            ceilings.flops_per_s[p] = ceilings.flops_per_s["fp32"]
            ceilings.notes.append(f"{p}: emulated with fp32 matmuls on the CPU; fp32 ceiling")
            continue
        rate, t, what = measure_matmul(device, p, n, budget_s)
        if p == "3xtf32" and on_cuda:
            # Three TF32 products per output: the achievable ideal is a third of TF32.
            rate /= 3.0
            what += " / 3 (3xTF32 does three TF32 products)"
        ceilings.flops_per_s[p] = rate
        ceilings.timings[f"matmul_{p}"] = {"what": what, **t.to_dict()}
        ceilings.notes.append(f"{p}: {what}: {rate / 1e9:.1f} GFLOP/s")
    return ceilings
