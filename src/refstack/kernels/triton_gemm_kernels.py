"""The Triton kernels behind ``triton_gemm`` (device code only).

Kept apart from the host wrappers because ``@triton.jit`` functions must live at
module level (the JIT resolves callees through module globals), and importing this
module imports Triton -- which ``refstack`` only does on first use on a CUDA device
(or under ``TRITON_INTERPRET=1``).  ``triton_gemm``'s docstring explains the design.
"""

from __future__ import annotations

import os
from typing import Any

import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def configs(kind: str) -> list[Any]:
    """Autotune space.  Shared memory per stage is (BM+BN)*BK*4 bytes (x2 for the
    presplit kernel, which streams four tiles: a, a_lo, b, b_lo); Hopper has 227 KB per SM, so large
    tiles trade pipeline depth against tile size.  128x256 / 256x128 tiles with 8
    warps give each warpgroup a 64-row wgmma slab and keep the MMA:load ratio high,
    which matters most when every tile step issues three MMAs."""
    if interpreting():  # one small config: the interpreter is slow and exact
        return [triton.Config({"BM": 32, "BN": 32, "BK": 16, "GROUP_M": 2}, num_stages=1, num_warps=4)]
    #          BM   BN   BK stages warps
    single = [(128, 256, 32, 3, 8), (256, 128, 32, 3, 8), (128, 128, 32, 4, 4),
              (128, 128, 64, 3, 8), (128, 256, 64, 2, 8), (64, 128, 32, 4, 4)]
    # Two fp32 accumulators live per tile (running sum + fresh partial), so 128x128
    # per 8 warps (128 registers of accumulators per thread) is the largest tile.
    split = [(128, 128, 16, 4, 8), (128, 128, 32, 3, 8), (128, 128, 16, 6, 8),
             (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
             # 16 warps = 4 warpgroups of 64 rows: a 256x128 tile at 64+64 accumulator
             # registers per thread, 1.33x the MMA work per byte loaded of 128x128.
             (256, 128, 16, 4, 16), (128, 256, 16, 4, 16), (256, 128, 32, 2, 16),
             # With A's residual made in registers only three tiles are streamed, so
             # deeper pipelines fit (48 KB a stage at 128x128x32).
             (128, 128, 32, 4, 8), (256, 128, 32, 3, 16)]
    table = split if kind == "presplit" else single
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for bm, bn, bk, s, w in table]



@triton.jit
def _tile_offsets(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row-blocks walk the N dimension together, so a B
    # column block is fetched from HBM once per group rather than once per row-block.
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % rows)
    pid_n = (pid % per_group) // rows
    return pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN)


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                 PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile_offsets(M, N, BM, BN, GROUP_M)
    rk = tl.arange(0, BK)
    a_p = a_ptr + rm[:, None] * sam + rk[None, :] * sak
    b_p = b_ptr + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_p, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(b_p, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_p += BK * sak
        b_p += BK * sbk
    c_p = c_ptr + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c_p, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gemm3_kernel(a_ptr, alo_ptr, b_ptr, blo_ptr, c_ptr, M, N, K,
                  sam, sak, slam, slak, sbk, sbn, slbk, slbn, scm, scn, EXPLICIT_HI: tl.constexpr,
                  A_LO_IN_KERNEL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile_offsets(M, N, BM, BN, GROUP_M)
    rk = tl.arange(0, BK)
    a_off = rm[:, None] * sam + rk[None, :] * sak
    alo_off = rm[:, None] * slam + rk[None, :] * slak
    b_off = rk[:, None] * sbk + rn[None, :] * sbn
    blo_off = rk[:, None] * slbk + rn[None, :] * slbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a_m = (rm[:, None] < M) & (rk[None, :] + k0 < K)
        b_m = (rk[:, None] + k0 < K) & (rn[None, :] < N)
        a = tl.load(a_ptr + a_off, mask=a_m, other=0.0)
        if A_LO_IN_KERNEL:  # one operand fewer to stream: a_lo from the a tile in registers
            a_lo = a - (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        else:
            a_lo = tl.load(alo_ptr + alo_off, mask=a_m, other=0.0)
        b = tl.load(b_ptr + b_off, mask=b_m, other=0.0)
        b_lo = tl.load(blo_ptr + blo_off, mask=b_m, other=0.0)
        if EXPLICIT_HI:  # interpreter: dots are exact, so truncate the big parts here
            a = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            b = (b.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        # Hopper's TF32 MMA adds into its fp32 accumulator with truncation, so a long
        # chain of MMAs drifts (measured: rel. error ~ (K/8) * 2**-24, 3e-5 at K=4096).
        # Each K-block therefore starts a fresh partial (small products first, while it
        # is small) and is added to the running sum by an ordinary round-to-nearest add.
        part = tl.dot(a_lo, b, input_precision="tf32")
        part = tl.dot(a, b_lo, part, input_precision="tf32")
        part = tl.dot(a, b, part, input_precision="tf32")
        acc += part
        a_off += BK * sak
        alo_off += BK * slak
        b_off += BK * sbk
        blo_off += BK * slbk
    c_p = c_ptr + rm[:, None] * scm + rn[None, :] * scn
    tl.store(c_p, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, R, C, sxr, sxc, sor, soc,
                  WRITE_HI: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # lo = x - tf32(x), optionally also a copy of x, both written with the output
    # strides (used to turn an N-major B into the K-major layout TF32 wgmma needs).
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(x_ptr + r[:, None] * sxr + c[None, :] * sxc, mask=m)
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    out = r[:, None] * sor + c[None, :] * soc
    tl.store(lo_ptr + out, x - hi, mask=m)
    if WRITE_HI:
        tl.store(hi_ptr + out, x, mask=m)


# Strides are in the keys: whether B is K-major changes which instructions (and so
# which tile shape) win.
gemm_kernel = triton.autotune(configs=configs("single"), key=["M", "N", "K", "sak", "sbk", "PRECISION"])(_gemm_kernel)
gemm3_kernel = triton.autotune(configs=configs("presplit"), key=["M", "N", "K", "sak", "sbk", "A_LO_IN_KERNEL"])(_gemm3_kernel)
split_kernel = _split_kernel
