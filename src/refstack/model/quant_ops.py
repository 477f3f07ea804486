"""W8A8's int8 arithmetic, shared by every path that runs it, and which GEMM backend runs it.

- ``quantize_weight``: int8 codes per output channel (symmetric, scale = max |w| / 127);
- ``quantize_rows``: int8 codes per row (per token) of the activations, times the explicit
  1/s when given: the same arithmetic as the native kernels' ``quantize_row``
  (``cpu_kernels.int8_quantize``) and the Triton kernel, bit for bit;
- ``int_mm``: the exact int32 product through ``torch._int_mm`` (CPU, or CUDA without
  Triton), and ``int_mm_unavailable_reason``: whether it runs here;
- ``fused_gpu_kernel`` / ``fused_kernel_for``: the one-launch Triton GEMM on CUDA where
  Triton is installed;
- ``dequantize``: int32 sums back to fp32 with the row and column scales.

Separate from the modules that hold the codes (``quant_layers``) and from the recipe that
makes them (``quant``, ``quant_recipe``): tests and the benchmark check the kernels against
this arithmetic alone, and the placement check (``refstack.engine.device``) asks about
``torch._int_mm`` without building a model.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["QMAX", "dequantize", "fused_gpu_kernel", "fused_kernel_for", "int_mm", "int_mm_unavailable_reason",
           "quantize_rows", "quantize_weight"]

log = logging.getLogger(__name__)

QMAX = 127


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> int8 codes [N, K] and fp32 scales [N]: symmetric, per output channel (row)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_rows(x: Tensor, inv_s: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] (times ``inv_s`` [K] when given) -> int8 codes [M, K] and fp32 scales [M]:
    symmetric, per row (per token): scale = max |x| / 127, codes = round(x * (1 / scale)),
    half to even.  The same arithmetic as the native kernels' ``quantize_row``
    (``cpu_kernels.int8_quantize``), bit for bit."""
    xs = x.float() * inv_s if inv_s is not None else x.float()
    scale = xs.abs().amax(dim=1) / QMAX
    recip = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))  # one divide per row, as the kernel
    q = torch.round(xs * recip[:, None]).clamp_(-QMAX, QMAX)
    q = torch.where((scale > 0)[:, None], q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a [M, K] @ b [K, N]``, int8 in, exact int32 out, through ``torch._int_mm``.

    On CUDA, ``_int_mm`` wants more than 16 rows and K and N multiples of 8: the rows are
    padded here (``b`` must come padded, see ``quant_layers.QuantizedLinear._mm_weight``).  Untested
    here: the project's GPU tests are skipped without a device."""
    if a.is_cuda:
        M, K = a.shape
        Kb = b.shape[0]
        rows = max(32, -(-M // 8) * 8)
        if rows != M or Kb != K:
            a = F.pad(a, (0, Kb - K, 0, rows - M))
        return torch._int_mm(a, b)[:M]
    return torch._int_mm(a, b)


@functools.cache
def int_mm_unavailable_reason(device: str = "cpu") -> str | None:
    """None when ``torch._int_mm`` runs on ``device`` ("cpu" or "cuda") and gives exact
    products on a small probe; else why not (one line)."""
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (64, 32), generator=gen, dtype=torch.int8)
        b_dev = b.to(device)
        if b_dev.is_cuda:  # the column-major operand int_mm passes there
            b_dev = b_dev.t().contiguous().t()
        got = torch._int_mm(a.to(device), b_dev).cpu()
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"torch._int_mm does not run on {device} with torch {torch.__version__} ({str(exc).splitlines()[0]})"
    if got.dtype != torch.int32 or not torch.equal(got.long(), a.long() @ b.long()):
        return f"torch._int_mm gives wrong products on {device} with torch {torch.__version__}"
    return None


@functools.cache
def fused_gpu_kernel() -> Any:
    """``refstack.kernels.w8a8_triton`` (one Triton launch per W8A8 GEMM on CUDA), or None
    where Triton is not installed: CUDA then takes the unfused ``torch._int_mm`` path."""
    try:
        from refstack.kernels import w8a8_triton
    except ImportError:
        log.info("W8A8 on CUDA: triton is not installed; using torch._int_mm and separate quantise/dequantise kernels")
        return None
    return w8a8_triton


def fused_kernel_for(x: Tensor) -> Any:
    """``w8a8_triton`` for a CUDA tensor where Triton is installed, else None (the unfused path)."""
    return fused_gpu_kernel() if x.is_cuda else None


def dequantize(acc: Tensor, sx: Tensor, sw: Tensor) -> Tensor:
    """int32 sums -> fp32, times the row scale and the column scale (as the C epilogue)."""
    return acc.float() * (sx[:, None] * sw[None, :])
