"""W8A8 on the GPU in one Triton launch per GEMM: per-token int8 quantisation of the
activations, the int8 x int8 -> int32 product on the tensor cores, and the dequantising
epilogue, fused.

Why: the unfused path (``refstack.model.quant_ops``: ``quantize_rows``, ``torch._int_mm``,
``dequantize``) is about ten small kernels per GEMM, and an MoE layer's experts run it
once per expert.  refstack's decode step on a GPU is launch-bound at these model sizes,
so that made W8A8 3-4x slower than bf16 on an H200 (docs/performance.md).  Here a GEMM
is one launch, and a padded MoE buffer ``[E, capacity, K]`` is one launch for all its
experts (the expert is the grid's third axis), as the bf16 path's one ``bmm``.

The arithmetic is ``quantize_rows``' and ``dequantize``'s, operation for operation, so the
result is the same bits as the unfused path (tested): ``xs = x * inv_s`` (fp32),
``scale = max|xs| / 127`` per row, ``codes = rint(xs * (1 / scale))`` clamped to
[-127, 127] (0 for an all-zero row), ``y = float(sum codes * w) * (scale * w_scale)``.
A program owns ``BLOCK_M`` rows and ``BLOCK_N`` columns: it reads its rows twice (the
row maximum, then the codes), cheap beside the weights at decode sizes, where the rows
are few and short and the weights are what streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w8a8_kernel(
    x_ptr, inv_s_ptr, w_ptr, w_scale_ptr, y_ptr,
    M, N, K,
    sx_e, sx_m, sx_k,
    si_e,
    sw_e, sw_k, sw_n,
    ss_e,
    sy_e, sy_m, sy_n,
    HAS_INV_S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_base = x_ptr + e * sx_e + rows[:, None] * sx_m
    # Pass 1: each row's max |x * inv_s| (the per-token scale needs the whole row).
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_base + ks[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if HAS_INV_S:
            x = x * tl.load(inv_s_ptr + e * si_e + ks, mask=k_ok, other=0.0)[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    # Correctly rounded divisions (``/`` lowers to an approximate one on NVIDIA GPUs), as
    # torch's: the codes must be the unfused path's bits.
    scale = tl.div_rn(amax, tl.full([BLOCK_M], 127.0, tl.float32))
    nonzero = scale > 0
    recip = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.where(nonzero, scale, 1.0))
    # Pass 2: quantise each K block of the rows and accumulate its int8 product.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    w_base = w_ptr + e * sw_e + cols[None, :] * sw_n
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_base + ks[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if HAS_INV_S:
            x = x * tl.load(inv_s_ptr + e * si_e + ks, mask=k_ok, other=0.0)[None, :]
        # Round half to even, as torch.round: adding and subtracting 1.5 * 2^23 leaves the
        # integer nearest (ties to even) for |v| < 2^22, and |v| <= 127 here.  The launch
        # turns FMA contraction off, so that x * recip is rounded before the add, as in torch.
        v = x * recip[:, None]
        q = (v + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        q = tl.where(nonzero[:, None], q, 0.0).to(tl.int8)
        w = tl.load(w_base + ks[:, None] * sw_k, mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc += tl.dot(q, w, out_dtype=tl.int32)
    w_scale = tl.load(w_scale_ptr + e * ss_e + cols, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * (scale[:, None] * w_scale[None, :])
    tl.store(y_ptr + e * sy_e + rows[:, None] * sy_m + cols[None, :] * sy_n, y, mask=row_ok[:, None] & col_ok[None, :])


def _block_m(m: int) -> int:
    # The int8 MMA wants at least 16 rows; decode batches are small, so a bigger block
    # would mostly compute masked rows.
    return 16 if m <= 16 else 32 if m <= 32 else 64


def w8a8_matmul(x: torch.Tensor, w_kn: torch.Tensor, w_scale: torch.Tensor,
                inv_s: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``dequant(quantize_rows(x, inv_s) @ w_kn)``, fused.

    ``x`` [M, K] or [E, M, K] (any float dtype); ``w_kn`` int8 codes as [K, N] or
    [E, K, N] (any strides: a transposed view of [N, K] codes works); ``w_scale`` [N] or
    [E, N] fp32; ``inv_s`` [K] or [E, K] fp32, or None.  Returns [M, N] or [E, M, N] fp32."""
    batched = x.dim() == 3
    if not batched:
        x, w_kn, w_scale = x.unsqueeze(0), w_kn.unsqueeze(0), w_scale.unsqueeze(0)
        inv_s = inv_s.unsqueeze(0) if inv_s is not None else None
    E, M, K = x.shape
    N = w_kn.shape[2]
    if w_kn.shape[:2] != (E, K) or w_scale.shape != (E, N) or w_kn.dtype != torch.int8:
        raise ValueError(f"w8a8_matmul: x {tuple(x.shape)} needs int8 codes [E, K, N] = [{E}, {K}, N] and "
                         f"scales [E, N]; got {w_kn.dtype} {tuple(w_kn.shape)} and {tuple(w_scale.shape)}")
    if inv_s is not None and inv_s.shape != (E, K):
        raise ValueError(f"w8a8_matmul: inv_s {tuple(inv_s.shape)} does not match [E, K] = [{E}, {K}]")
    y = torch.empty(E, M, N, dtype=torch.float32, device=x.device)
    if M == 0 or N == 0:
        return y if batched else y[0]
    bm, bn, bk = _block_m(M), 64, 64
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), E)
    inv = inv_s if inv_s is not None else w_scale  # a placeholder pointer, never read
    _w8a8_kernel[grid](
        x, inv, w_kn, w_scale, y, M, N, K,
        x.stride(0), x.stride(1), x.stride(2),
        inv.stride(0),
        w_kn.stride(0), w_kn.stride(1), w_kn.stride(2),
        w_scale.stride(0),
        y.stride(0), y.stride(1), y.stride(2),
        HAS_INV_S=inv_s is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, enable_fp_fusion=False,
    )
    return y if batched else y[0]
