"""A GEMM whose arithmetic precision is a knob: fp32, tf32, 3xtf32 or bf16.

``matmul(a, b, precision)`` computes ``a @ b`` and always returns fp32.

On the CPU every mode is *emulated* with exact fp32 arithmetic on rounded inputs:

- ``tf32``: each input keeps its top 10 explicit mantissa bits.  We **truncate**
  (``bits & 0xFFFFE000``), i.e. round toward zero, rather than round to nearest.
  Why: truncation is what the 3xTF32 split is defined with (the residual
  ``x - big`` then has the same sign as ``x`` and is exactly representable), it is
  one bit-mask with no tie or overflow cases, and it matches what a Triton
  ``tl.dot(input_precision="tf32")`` does with fp32 operands (the MMA ignores the
  low 13 mantissa bits; on an H200 Triton tf32 shows ~7.9e-4 relative error, the
  truncation level, against cuBLAS tf32's ~2.9e-4, which rounds to nearest first).
  Unit roundoff is 2**-10 for truncation vs 2**-11 for nearest, so emulated errors
  bound cuBLAS tf32 from above -- never below.
  The product of two TF32 numbers (11-bit significands) is exact in fp32 (24
  bits), so ``tf32(a) @ tf32(b)`` in fp32 models a tensor-core MMA with fp32
  accumulation up to the accumulation order.
- ``3xtf32``: ``big = tf32(x)``, ``small = tf32(x - big)``, result
  ``small_a@big_b + big_a@small_b + big_a@big_b`` (small terms first, so they are
  not absorbed by the large partial sum).  ``small_a@small_b`` (~2**-22 relative)
  is dropped, as on the GPU.  ``small`` is itself rounded to TF32 because the
  tensor core would round it anyway.
- ``bf16``: inputs rounded to bfloat16 (round to nearest, torch's cast), products
  accumulated in fp32.

On CUDA the same modes run on hardware: fp32 through cuBLAS with TF32 disabled,
tf32 / 3xtf32 / bf16 through the Triton GEMM in ``triton_gemm`` (``tl.dot``
``input_precision`` "tf32" / "tf32x3", bf16 operands).  ``matmul_emulated`` runs the
CPU emulation on any device, for comparisons that must not depend on hardware.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "3xtf32", "bf16")

# Sign, 8 exponent bits and the top 10 of 23 mantissa bits: 1+8+10 = 19 bits kept.
_TF32_MASK = -8192  # == 0xFFFFE000 as a signed int32


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` toward zero to TF32 (10 explicit mantissa bits), kept in fp32."""
    x = x.to(torch.float32).contiguous()
    return (x.view(torch.int32) & _TF32_MASK).view(torch.float32)


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x ~= big + small`` with both parts TF32-representable (the 3xTF32 split).

    ``x - big`` is exact in fp32 (Sterbenz-like: same sign, smaller magnitude, fits
    in 13 bits), so the only loss is the truncation of ``small`` to TF32, about
    2**-21 relative to ``x``.
    """
    x = x.to(torch.float32)
    big = tf32_truncate(x)
    small = tf32_truncate(x - big)
    return big, small


@contextmanager
def _cublas_ieee_fp32() -> Iterator[None]:
    """Force true fp32 GEMMs in cuBLAS for the duration (restored afterwards).

    PyTorch's default may route fp32 matmuls to TF32 tensor cores depending on a
    process-wide flag; the fp32 reference must not depend on that flag.
    """
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag


def matmul_emulated(a: torch.Tensor, b: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """The reference semantics of each mode, computed with true fp32 GEMMs on rounded
    inputs.  Runs on any device; on CUDA it is as slow as fp32 (it is a reference)."""
    _check_precision(precision)
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    with _cublas_ieee_fp32():
        if precision == "fp32":
            return a32 @ b32
        if precision == "tf32":
            return tf32_truncate(a32) @ tf32_truncate(b32)
        if precision == "bf16":
            return a32.to(torch.bfloat16).to(torch.float32) @ b32.to(torch.bfloat16).to(torch.float32)
        a_big, a_small = split_tf32(a32)
        b_big, b_small = split_tf32(b32)
        return (a_small @ b_big + a_big @ b_small) + a_big @ b_big


def matmul(a: torch.Tensor, b: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """``a @ b`` at the given precision; ``a`` is ``[..., K]``, ``b`` is ``[K, N]``.

    Returns fp32 ``[..., N]``.  CPU tensors use the emulation above; CUDA tensors
    use cuBLAS (fp32) or the Triton GEMM (tf32, 3xtf32, bf16).
    """
    _check_precision(precision)
    if a.shape[-1] != b.shape[0] or b.dim() != 2:
        raise ValueError(f"matmul needs a [..., K] and b [K, N]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if not a.is_cuda:
        return matmul_emulated(a, b, precision)
    if precision == "fp32":
        with _cublas_ieee_fp32():
            return a.to(torch.float32) @ b.to(torch.float32)
    from refstack.kernels.triton_gemm import gemm  # lazy: Triton is GPU-only baggage

    lead = a.shape[:-1]
    out = gemm(a.reshape(-1, a.shape[-1]), b, precision=precision)
    return out.reshape(*lead, b.shape[1])
