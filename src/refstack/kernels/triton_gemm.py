"""Triton GEMM ``c = a @ b`` (fp32 in, fp32 out) with a precision knob, tuned for Hopper.

``gemm(a, b, precision)``, precision in:

- ``"ieee"`` (alias ``"fp32"``): true fp32 FMA arithmetic (slow; a reference);
- ``"tf32"``: one TF32 tensor-core MMA per tile step;
- ``"tf32x3"`` (alias ``"3xtf32"``): big*big + big*small + small*big, three TF32
  MMAs per tile step;
- ``"bf16"``: operands rounded to bf16 once, bf16 MMAs, fp32 accumulation.

Three Hopper facts shape the tf32/tf32x3 paths (each measured on an H200, see
docs/performance.md):

1. TF32 ``wgmma`` takes both operands K-major from shared memory (transposed tiles
   are a 16-bit-type feature).  An N-major B sends Triton down a slower MMA path
   (140 vs ~280 TFLOP/s), so ``gemm`` makes B K-major first unless ``k_major=False``.
   An ``nn.Linear`` weight used as ``x @ W.T`` already is.
2. A TF32 MMA reads only the top 19 bits of an fp32 operand, i.e. it *truncates*
   (Triton tf32 matches the truncation emulation at fp32 level).  So ``tf32(x)``
   never has to be materialised: raw ``x`` is the big part.
3. The MMA adds into its fp32 accumulator with truncation too, so a long chain of
   MMAs drifts: rel. error ~ (K/8) * 2**-24 (3e-5 at K=4096).  Exact-looking 3xTF32
   therefore needs each K-block's products in a fresh partial, added to the running
   sum by an ordinary round-to-nearest add.

``tf32x3_impl``:

- ``"auto"`` (default): ``"gluon"`` on a Hopper GPU when Triton has Gluon and the
  operands suit the copy engine (K % 4 == 0), ``"presplit"`` everywhere else
  (other GPUs, and the CPU interpreter the tests use).
- ``"gluon"``: ``gluon_gemm3``, the presplit scheme written in Gluon so that all
  three MMAs take A from registers and tile copies are issued under the MMAs;
  5-15% faster than ``"presplit"`` on an H200 (docs/performance.md).
- ``"presplit"``: one elementwise pass writes ``b_lo = b - tf32(b)`` (and
  a K-major copy of B if needed); the K loop streams ``a, b, b_lo`` tiles, makes
  ``a_lo`` from the A tile in registers, and per K-block computes
  ``a_lo@b + a@b_lo + a@b`` into a fresh partial (small products first).
  ``b_split`` takes a precomputed ``split_operand(W.T, 0)`` for a fixed weight.
  Under ``TRITON_INTERPRET=1`` a dot is an exact fp32 matmul, so there the kernel
  truncates the big parts explicitly (``EXPLICIT_HI``) to compute the same function.
- ``"native"``: ``tl.dot(input_precision="tf32x3")``, Triton's own in-loop split;
  accurate, ~10% slower than presplit on an H200.

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


@functools.cache
def _kernels() -> dict[str, Any]:
    """Import the device code on first use, so importing refstack never imports Triton."""
    from refstack.kernels import triton_gemm_kernels as kk

    return {"single": kk.gemm_kernel, "presplit": kk.gemm3_kernel, "split": kk.split_kernel}


@functools.cache
def _gluon_gemm3_on(device_index: int) -> bool:
    """Whether the Gluon kernel can run on this CUDA device: Hopper (wgmma) and a Triton with Gluon."""
    if _interpreting() or torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    try:
        from refstack.kernels import gluon_gemm3  # noqa: F401
    except ImportError:  # a Triton without Gluon's Hopper API: the Triton kernel serves
        return False
    return True


def _grid(meta: dict[str, int], M: int, N: int) -> tuple[int]:
    return (((M + meta["BM"] - 1) // meta["BM"]) * ((N + meta["BN"] - 1) // meta["BN"]),)


def _is_k_major(x: torch.Tensor, k_dim: int) -> bool:
    return x.stride(k_dim) == 1 or x.shape[k_dim] == 1


def _k_major_empty(x: torch.Tensor, k_dim: int) -> torch.Tensor:
    rows, cols = x.shape
    if k_dim == 1:
        return torch.empty((rows, cols), device=x.device, dtype=torch.float32)
    return torch.empty((cols, rows), device=x.device, dtype=torch.float32).t()


def split_operand(x: torch.Tensor, k_dim: int, want_lo: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x_k, x_lo)`` for a GEMM operand whose reduction dimension is ``k_dim``.

    ``x_k`` is ``x`` itself when it is already K-major, else a K-major copy: TF32
    ``wgmma`` reads both operands from shared memory K-major only (transposed tiles are
    a 16-bit-type feature), so an N-major B would push Triton onto the older, slower
    MMA path.  ``x_lo = x - tf32(x)`` (truncation), K-major, or None.  One pass over
    ``x`` writes both.  For a weight (the LM head) call this once and reuse the result.
    """
    assert x.dim() == 2 and x.dtype == torch.float32
    already = _is_k_major(x, k_dim)
    if already and not want_lo:
        return x, None
    lo = _k_major_empty(x, k_dim)
    hi = x if already else _k_major_empty(x, k_dim)
    R, C = x.shape
    BR, BC = 64, 64
    grid = ((R + BR - 1) // BR, (C + BC - 1) // BC)
    _kernels()["split"][grid](x, hi, lo, R, C, *x.stride(), *lo.stride(), WRITE_HI=not already, BR=BR, BC=BC)
    return hi, (lo if want_lo else None)


def split_lo(x: torch.Tensor) -> torch.Tensor:
    """``x - tf32(x)`` for a 2-D fp32 tensor, row-major (``split_operand(x, 1)``)."""
    lo = split_operand(x, k_dim=1)[1]
    assert lo is not None
    return lo


def gemm(a: torch.Tensor, b: torch.Tensor, precision: str = "tf32", *,
         tf32x3_impl: str = "auto", b_split: tuple[torch.Tensor, torch.Tensor] | None = None,
         k_major: bool = True, a_lo_in_kernel: bool = True) -> torch.Tensor:
    """``a [M, K] @ b [K, N]``, fp32 out.  See the module docstring for ``precision`` and
    ``tf32x3_impl``.  ``b_split`` supplies ``split_operand(b, 0)`` precomputed (a weight);
    ``k_major=False`` keeps an N-major B as it is (slower on Hopper; for comparison);
    ``a_lo_in_kernel=False`` streams a precomputed A residual instead of deriving it
    from the A tile in registers (measured slower on an H200; kept for comparison)."""
    precision = _ALIASES.get(precision, precision)
    if precision not in INPUT_PRECISIONS:
        raise ValueError(f"precision must be one of {INPUT_PRECISIONS} (or fp32/3xtf32), got {precision!r}")
    if tf32x3_impl not in ("auto", "gluon", "presplit", "native"):
        raise ValueError(f"tf32x3_impl must be 'auto', 'gluon', 'presplit' or 'native', got {tf32x3_impl!r}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm needs a [M, K] and b [K, N]; got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=torch.float32)
    k = _kernels()
    if precision == "bf16":
        # Round once on the way in (not per tile step); the MMA accumulates in fp32.
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        prec = "tf32"  # ignored for 16-bit operands
        if _interpreting():  # the interpreter cannot dot bf16 blocks; same values in fp32
            a16, b16, prec = a16.to(torch.float32), b16.to(torch.float32), "ieee"
        k["single"][lambda m: _grid(m, M, N)](
            a16, b16, c, M, N, K, *a16.stride(), *b16.stride(), *c.stride(), PRECISION=prec)
        return c
    a, b = a.to(torch.float32), b.to(torch.float32)
    if precision == "tf32x3" and tf32x3_impl != "native":
        # Gluon makes a_lo in registers itself, so "auto" takes it only when the caller did not ask to stream a_lo.
        gluon = tf32x3_impl == "gluon" or (tf32x3_impl == "auto" and a_lo_in_kernel)
        if gluon and not (a.is_cuda and _gluon_gemm3_on(a.device.index or 0)):
            if tf32x3_impl == "gluon":
                raise ValueError("tf32x3_impl='gluon' needs a Hopper GPU and a Triton with Gluon")
            gluon = False
        # Both kernels take the same split operands; made once, also when Gluon declines them below.
        stream_a_lo = not (gluon or a_lo_in_kernel)
        a_k, a_lo = split_operand(a, k_dim=1, want_lo=stream_a_lo)
        b_k, b_lo = b_split if b_split is not None else split_operand(b, k_dim=0)
        assert b_lo is not None
        if gluon:
            from refstack.kernels import gluon_gemm3

            if gluon_gemm3.supported(a_k, b_k.t(), b_lo.t()):
                return gluon_gemm3.gemm3(a_k, b_k.t(), b_lo.t(), out=c)
            if tf32x3_impl == "gluon":
                raise ValueError("tf32x3_impl='gluon' needs K % 4 == 0 and 16-byte-aligned operands")
        a_lo = a_k if a_lo is None else a_lo  # unused by the kernel when it makes a_lo itself
        k["presplit"][lambda m: _grid(m, M, N)](
            a_k, a_lo, b_k, b_lo, c, M, N, K, *a_k.stride(), *a_lo.stride(), *b_k.stride(),
            *b_lo.stride(), *c.stride(), EXPLICIT_HI=_interpreting(), A_LO_IN_KERNEL=not stream_a_lo)
        return c
    if k_major and precision != "ieee":
        a = split_operand(a, k_dim=1, want_lo=False)[0]
        b = split_operand(b, k_dim=0, want_lo=False)[0]
    k["single"][lambda m: _grid(m, M, N)](
        a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(), PRECISION=precision)
    return c
