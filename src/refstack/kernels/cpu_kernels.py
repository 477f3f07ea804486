"""Native fp32 kernels for the CPU decode path: the library's entry points, the GEMM and RMSNorm.

``cpu_kernels.c``, ``cpu_bf16.c``, ``cpu_attention.c`` and ``cpu_int8.c`` (built and loaded
by ``cpu_build``) hold every kernel; their wrappers are one module per family:

- here: ``gemm`` (``x @ W`` over a weight packed once into column blocks), ``rms_norm``
  (optionally after a residual add or with a sigmoid gate), and the int8 tiles of W8A8
  (``int8_mm``, ``int8_quantize``, ``int8_portable``) for the tests and the benchmark;
- ``cpu_moe``: an MoE layer's dispatch, experts and combine, and their expert-parallel
  forms (``ep_dispatch`` / ``ep_combine``);
- ``cpu_kda``: KDA's activations (``kda_prepare``) and its recurrence (``kda_scan``,
  ``kda_decode``, ``kda_scan_varlen``);
- ``cpu_attention``: ``gqa_decode``, one query token per sequence against its slot of the
  KV cache;
- ``cpu_blocks``: whole decode blocks (a KDA layer, an attention layer, the router);
- ``cpu_packs``: the weight layouts all of them read; ``cpu_operands``: the operand checks
  they share.

This module is also where callers ask whether the kernels load (``available``,
``unavailable_reason``, ``load``) and pack their weights (the ``cpu_packs`` names below).

Decode multiplies a handful of rows by every weight, the shape where MKL's sgemm is
slowest: on the 2-core AVX-512 bench box it streams a 1 MiB weight at 4-10 GB/s for
1-32 rows, the packed kernel at 12-30 GB/s (``bench/cpu_kernels.py``).  The other
kernels replace chains of small tensor ops whose per-op cost dominates at decode.
Results match torch to fp32 rounding, not bit for bit (different summation order);
a row's result never depends on the other rows in the call.

Every packing function takes ``dtype``: ``torch.float32``, or ``torch.bfloat16`` for
the bf16 GEMMs of ``cpu_bf16.c`` (weights rounded to bf16 when packed, activations
rounded to bf16 inside the call, fp32 accumulation): ``gemm``, ``cpu_moe.moe_experts`` and
``cpu_blocks.kda_decode_block`` pick the kernel from the packed weights' dtype.

W8A8 (``cpu_int8.c``, ``refstack.model.quant``): ``pack_w8a8`` / ``pack_gate_up_w8a8`` /
``pack_down_w8a8`` build *tagged* packs (``cpu_packs`` defines every layout, these included);
``gemm`` and ``cpu_moe.moe_experts`` take them too; ``gemm_kind`` is the kind number the
native decode blocks take (0 fp32, 1 bf16, 2 tagged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from refstack.kernels.cpu_build import (
    NativeKernelsUnavailable,
    available,
    load,
    unavailable_reason,
)
from refstack.kernels.cpu_operands import check_fp32

# The layouts live in cpu_packs; they are this module's API too (callers pack and call here).
from refstack.kernels.cpu_packs import (
    FORMAT_W8A8,
    NB,
    check_packed,
    fits,
    gemm_kind,
    is_tagged,
    pack,
    pack_down,
    pack_down_w8a8,
    pack_gate_up,
    pack_gate_up_w8a8,
    pack_w8a8,
    read_header,
)

__all__ = [
    "NativeKernelsUnavailable",
    "available",
    "bf16_dot_native",
    "gemm",
    "gemm_kind",
    "int8_dot_native",
    "int8_mm",
    "int8_portable",
    "int8_quantize",
    "load",
    "pack",
    "pack_down",
    "pack_down_w8a8",
    "pack_gate_up",
    "pack_gate_up_w8a8",
    "pack_w8a8",
    "rms_norm",
    "unavailable_reason",
]


def bf16_dot_native() -> bool:
    """True when the kernels load and their bf16 GEMMs run on a bf16 dot-product
    instruction (AVX512_BF16's ``vdpbf16ps``); elsewhere they are correct but widen
    every pair to fp32 first."""
    return available() and bool(load().refstack_bf16_dot_native())


def int8_dot_native() -> bool:
    """True when the kernels load and their int8 tiles run on AVX512-VNNI's ``vpdpbusd``;
    elsewhere the portable path computes the same integers."""
    return available() and bool(load().refstack_int8_dot_native())


@contextlib.contextmanager
def int8_portable(on: bool = True) -> Iterator[None]:
    """Run the int8 tiles on the portable path inside the block (tests compare the two paths).
    Process-wide: not while another thread runs a W8A8 kernel."""
    lib = load()
    was = lib.refstack_int8_force_portable(int(on))
    try:
        yield
    finally:
        lib.refstack_int8_force_portable(was)


def int8_mm(a: Tensor, pack: Tensor) -> Tensor:
    """The exact int32 products ``a [M, K] (int8) @ W`` for a W8A8 pack's int8 weights W [K, N]."""
    h = read_header(pack)
    if a.dtype != torch.int8 or a.dim() != 2 or a.shape[1] != h["K"] or h["format"] != FORMAT_W8A8:
        raise ValueError(f"int8_mm: a {a.dtype} {tuple(a.shape)} does not fit a pack of K={h['K']} format {h['format']}")
    a = a.contiguous()
    c = torch.empty(a.shape[0], h["N"], dtype=torch.int32)
    if load().refstack_int8_mm(a.data_ptr(), a.shape[0], h["K"], pack.data_ptr(), h["N"], c.data_ptr(),
                               torch.get_num_threads()):
        raise ValueError("refstack_int8_mm rejected its arguments")
    return c


def int8_quantize(x: Tensor, inv_s: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The kernels' per-row activation quantisation of x [M, K]: int8 codes [M, K] and scales [M]."""
    check_fp32("int8_quantize", x, *(t for t in (inv_s,) if t is not None))
    x = x.contiguous()
    M, K = x.shape
    codes = torch.empty(M, K, dtype=torch.int8)
    scales = torch.empty(M, dtype=torch.float32)
    inv = inv_s.contiguous() if inv_s is not None else None
    if load().refstack_int8_quantize(x.data_ptr(), M, K, inv.data_ptr() if inv is not None else None, codes.data_ptr(),
                                     scales.data_ptr()):
        raise ValueError(f"refstack_int8_quantize rejected M={M} K={K}")
    return codes, scales


def gemm(x: Tensor, packed: Tensor, n: int) -> Tensor:
    """``x [M, K] @ W`` for a weight W [K, n] packed by ``pack``; returns a new [M, n].

    A bf16 pack runs the bf16 kernel: x rounded to bf16, fp32 accumulation and result."""
    check_fp32("gemm", x)
    check_packed("gemm", packed)
    if is_tagged(packed):
        return _gemm_tagged(x, packed, n)
    bf16 = packed.dtype == torch.bfloat16
    if x.dim() != 2 or packed.dim() != (4 if bf16 else 3) or not fits(packed, x.shape[1]) or packed.shape[0] != -(-n // NB):
        raise ValueError(f"gemm: x {tuple(x.shape)} does not fit a packed weight {tuple(packed.shape)} with n={n}")
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()  # (expanded or overlapping rows; strided rows are read in place)
    M, K = x.shape
    y = torch.empty(M, n, dtype=x.dtype)
    ldx = x.stride(0) if M > 1 else K  # a one-row tensor may report any row stride
    kernel = load().refstack_gemm_bf16 if bf16 else load().refstack_gemm
    if M and kernel(x.data_ptr(), M, K, ldx, packed.data_ptr(), n, y.data_ptr(), n, torch.get_num_threads()):
        raise ValueError(f"refstack_gemm rejected M={M} K={K} N={n} ldx={x.stride(0)} dtype={packed.dtype}")
    return y


def _gemm_tagged(x: Tensor, packed: Tensor, n: int) -> Tensor:
    h = read_header(packed)
    if x.dim() != 2 or x.shape[1] != h["K"] or n != h["N"] or packed.numel() < h["total"]:
        raise ValueError(f"gemm: x {tuple(x.shape)} does not fit a tagged pack of K={h['K']} N={h['N']} with n={n}")
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, n, dtype=x.dtype)
    ldx = x.stride(0) if M > 1 else K
    if M and load().refstack_gemm_tagged(x.data_ptr(), M, K, ldx, packed.data_ptr(), n, y.data_ptr(), n,
                                         torch.get_num_threads()):
        raise ValueError(f"refstack_gemm_tagged rejected M={M} K={K} N={n} format={h['format']}")
    return y


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, residual_delta: Tensor | None = None,
             gate: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dim of ``x``, times ``sigmoid(gate)`` when given.

    With ``residual_delta``, ``x += residual_delta`` first, in place (``x`` must then be
    contiguous): the fused residual add of a pre-norm block.  Returns the normalised rows."""
    check_fp32("rms_norm", x, weight, *(t for t in (residual_delta, gate) if t is not None))
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {D}")
    for name, t in (("residual_delta", residual_delta), ("gate", gate)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"rms_norm: {name} {tuple(t.shape)} differs from x {tuple(x.shape)}")
    if residual_delta is not None and not x.is_contiguous():
        raise ValueError("rms_norm: x must be contiguous to take the residual add in place")
    x = x.contiguous()
    delta = residual_delta.contiguous() if residual_delta is not None else None
    g = gate.contiguous() if gate is not None else None
    y = torch.empty_like(x)
    rows = x.numel() // D
    if load().refstack_rms_norm(x.data_ptr(), delta.data_ptr() if delta is not None else None, rows, D,
                                weight.contiguous().data_ptr(), eps, g.data_ptr() if g is not None else None,
                                y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"refstack_rms_norm rejected rows={rows} D={D}")
    return y
