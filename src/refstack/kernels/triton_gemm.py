"""Triton GEMM ``c = a @ b`` (fp32 in, fp32 out) with a precision knob, tuned for Hopper.

``gemm(a, b, precision)``, precision in:

- ``"ieee"`` (alias ``"fp32"``): true fp32 FMA arithmetic (slow; a reference);
- ``"tf32"``: one TF32 tensor-core MMA per tile step;
- ``"tf32x3"`` (alias ``"3xtf32"``): big*big + big*small + small*big, three TF32
  MMAs per tile step;
- ``"bf16"``: operands rounded to bf16 once, bf16 MMAs, fp32 accumulation.

Why tf32x3 has two implementations (``tf32x3_impl``):

- ``"native"`` is ``tl.dot(input_precision="tf32x3")``.  Triton splits the operands
  *inside* the K loop, in registers.  On Hopper the B operand of ``wgmma`` must come
  from shared memory, so the split B is written back to shared memory every step,
  which serialises the otherwise asynchronous MMA pipeline.  A plain kernel built
  this way measured slower than cuBLAS fp32 on an H200 (see docs).
- ``"presplit"`` (default) computes only the residuals ``x_lo = x - tf32(x)`` in one
  cheap elementwise pass (O(MK + KN) bytes against O(MNK) FLOPs), then runs a
  GEMM whose K loop only *loads* tiles -- ``a, a_lo, b, b_lo`` -- straight into
  shared memory and issues three TF32 MMAs from there:
  ``a_lo@b + a@b_lo + a@b``.  The ``big`` parts are never materialised: a TF32
  MMA reads only the top 19 bits of an fp32 operand, so feeding it raw ``x`` *is*
  feeding it ``tf32(x)`` (truncation -- the same rounding ``x_lo`` was made with).
  That hardware behaviour is an assumption; ``bench/gemm_precision.py`` gates it
  (relative error vs fp64 <= 1e-6) before any speed is reported.  Under
  ``TRITON_INTERPRET=1`` a dot is an exact fp32 matmul, so there the kernel masks
  the big parts explicitly (``EXPLICIT_HI``) to compute the same function.

Tiles are ordered in groups of ``GROUP_M`` row-blocks so that consecutive programs
share B columns in L2.  Triton is imported lazily: importing this module is free.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

INPUT_PRECISIONS: tuple[str, ...] = ("ieee", "tf32", "tf32x3", "bf16")
_ALIASES = {"fp32": "ieee", "3xtf32": "tf32x3"}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels() -> dict[str, Any]:
    """Import the device code on first use, so importing refstack never imports Triton."""
    from refstack.kernels import triton_gemm_kernels as kk

    return {"single": kk.gemm_kernel, "presplit": kk.gemm3_kernel, "split_lo": kk.split_lo_kernel}


def _grid(meta: dict[str, int], M: int, N: int) -> tuple[int]:
    return (((M + meta["BM"] - 1) // meta["BM"]) * ((N + meta["BN"] - 1) // meta["BN"]),)


def split_lo(x: torch.Tensor) -> torch.Tensor:
    """``x - tf32(x)`` (truncation), same shape and strides as a dense ``x``.

    For a weight that does not change (the LM head), call this once and pass the
    result to ``gemm(..., b_lo=...)`` so every call skips the split pass for B."""
    assert x.dtype == torch.float32
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
        return split_lo(x.t()).t()  # a transposed weight view: split its storage
    x = x.contiguous()
    lo = torch.empty_like(x)
    n = x.numel()
    block = 1024
    _kernels()["split_lo"][(_cdiv(n, block),)](x, lo, n, BLOCK=block)
    return lo


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemm(a: torch.Tensor, b: torch.Tensor, precision: str = "tf32", *,
         tf32x3_impl: str = "presplit", b_lo: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` in fp32 out.  See the module docstring for ``precision``
    and ``tf32x3_impl``; ``b_lo`` optionally supplies ``split_lo(b)`` precomputed."""
    precision = _ALIASES.get(precision, precision)
    if precision not in INPUT_PRECISIONS:
        raise ValueError(f"precision must be one of {INPUT_PRECISIONS} (or fp32/3xtf32), got {precision!r}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm needs a [M, K] and b [K, N]; got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=torch.float32)
    k = _kernels()
    if precision == "bf16":
        # Round once on the way in (not per tile step); the MMA accumulates in fp32.
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        if _interpreting():  # the interpreter cannot dot bf16 blocks; same values in fp32
            a16, b16 = a16.to(torch.float32), b16.to(torch.float32)
            k["single"][lambda m: _grid(m, M, N)](
                a16, b16, c, M, N, K, *a16.stride(), *b16.stride(), *c.stride(), PRECISION="ieee")
            return c
        k["single"][lambda m: _grid(m, M, N)](
            a16, b16, c, M, N, K, *a16.stride(), *b16.stride(), *c.stride(), PRECISION="tf32")
        return c
    a, b = a.to(torch.float32), b.to(torch.float32)
    if precision == "tf32x3" and tf32x3_impl == "presplit":
        a_lo = split_lo(a)
        b_lo = split_lo(b) if b_lo is None else b_lo
        # The kernel indexes a_lo/b_lo with a's/b's strides: make the layouts agree.
        if a_lo.stride() != a.stride():
            a, a_lo = a.contiguous(), a_lo.contiguous()
        if b_lo.stride() != b.stride():
            b, b_lo = b.contiguous(), b_lo.contiguous()
        k["presplit"][lambda m: _grid(m, M, N)](
            a, a_lo, b, b_lo, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
            EXPLICIT_HI=_interpreting())
        return c
    if tf32x3_impl not in ("presplit", "native"):
        raise ValueError(f"tf32x3_impl must be 'presplit' or 'native', got {tf32x3_impl!r}")
    k["single"][lambda m: _grid(m, M, N)](
        a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), PRECISION=precision)
    return c
