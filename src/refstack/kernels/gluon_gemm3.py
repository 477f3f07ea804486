"""3xTF32 GEMM written in Gluon for Hopper (device code plus its launcher).

Why a second kernel beside ``triton_gemm_kernels._gemm3_kernel``: on an H200 that
kernel issues TF32 ``wgmma`` at ~290 TFLOP/s, and counting shared-memory bytes per
K-block says why it stops there.  For a 128x128x32 tile and two warpgroups, every MMA
reads its B operand from shared memory (96 KB per K-block over the three products),
the copy engine writes the a, b and b_lo tiles (48 KB), and when A also comes from
shared memory the two ``a @ .`` products read it twice more (32 KB): ~190 KB per
~1470 MMA cycles, about the 128 B/cycle shared memory delivers.  Gluon lets the
kernel say where each operand lives and when each copy is issued:

- the A tile is read into registers once; ``a_lo = a - tf32(a)`` is made there, and
  all three MMAs take A from registers (~160 KB per K-block);
- the copy for block kk+STAGES-1 is issued while block kk's MMAs run, into the slot
  block kk-1 used (free: every warp has waited for its MMAs), so issuing copies is
  off the MMA's critical path.

The accuracy scheme is ``triton_gemm``'s: each K-block's three products go into a
fresh partial (small products first), which an ordinary round-to-nearest add folds
into the running sum, because Hopper's TF32 MMA truncates when it accumulates.

B comes K-major, as ``[N, K]`` row-major tensors (``split_operand(b, 0)`` transposed).
The copy engine needs 16-byte-aligned rows, i.e. K % 4 == 0; ``supported`` says when
this kernel applies.  Importing this module imports Triton's Gluon, which
``triton_gemm`` does only on first use on a Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Measured on an H200 (docs/performance.md): 128x128x32 with 4 slots beat 3 slots,
# BK 16 (6 slots), BK 64 (2 slots), 64-row tiles, A from shared memory, and adding
# the previous block's partial under the next block's MMAs (a third accumulator).
BM, BN, BK, STAGES, GROUP_M = 128, 128, 32, 4, 8


@gluon.jit
def _tf32_trunc(x):
    return (x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)


@gluon.jit
def _load_block(a_desc, b_desc, blo_desc, a_s, b_s, bl_s, bars, slot, k, off_m, off_n, pred):
    bar = bars.index(slot)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + blo_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_s.index(slot), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_s.index(slot), pred=pred)
    tma.async_copy_global_to_shared(blo_desc, [off_n, k], bar, bl_s.index(slot), pred=pred)


@gluon.jit
def gemm3_kernel(a_desc, b_desc, blo_desc, c_ptr, M, N, K, stride_cm,
                 GROUP: gl.constexpr, SLOTS: gl.constexpr, num_warps: gl.constexpr):
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TK: gl.constexpr = a_desc.block_type.shape[1]
    TN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(TM == 16 * num_warps, "one 16-row MMA slab per warp")

    # Grouped tile order: GROUP row-blocks walk N together and share B in L2.
    pid = gl.program_id(0)
    n_n = gl.cdiv(N, TN)
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    rows = gl.minimum(gl.cdiv(M, TM) - first_m, GROUP)
    off_m = (first_m + (pid % per_group) % rows) * TM
    off_n = ((pid % per_group) // rows) * TN

    a_s = gl.allocate_shared_memory(gl.float32, [SLOTS, TM, TK], a_desc.layout)
    b_s = gl.allocate_shared_memory(gl.float32, [SLOTS, TN, TK], b_desc.layout)
    bl_s = gl.allocate_shared_memory(gl.float32, [SLOTS, TN, TK], blo_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(bars.index(i), count=1)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, TN, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=1)
    acc = gl.zeros((TM, TN), dtype=gl.float32, layout=mma_layout)

    k_iters = gl.cdiv(K, TK)
    for i in gl.static_range(SLOTS - 1):  # one slot stays free for the first refill
        _load_block(a_desc, b_desc, blo_desc, a_s, b_s, bl_s, bars, i, i * TK, off_m, off_n, i < k_iters)

    for kk in range(k_iters):
        slot = kk % SLOTS
        mbarrier.wait(bars.index(slot), (kk // SLOTS) & 1)
        b_t = b_s.index(slot).permute((1, 0))
        bl_t = bl_s.index(slot).permute((1, 0))
        a = a_s.index(slot).load(a_layout)
        a_lo = a - _tf32_trunc(a)
        # The MMA reads only the top 19 bits of fp32 a and b: the raw values are the big parts.
        part = warpgroup_mma(a_lo, b_t, acc, use_acc=False, is_async=True)
        part = warpgroup_mma(a, bl_t, part, is_async=True)
        part = warpgroup_mma(a, b_t, part, is_async=True)
        # While they run: every warp has passed block kk-1's MMA wait, so its slot is free.
        gl.thread_barrier()
        fence_async_shared()
        nxt = kk + SLOTS - 1
        _load_block(a_desc, b_desc, blo_desc, a_s, b_s, bl_s, bars, nxt % SLOTS, nxt * TK, off_m, off_n,
                    nxt < k_iters)
        part = warpgroup_mma_wait(0, deps=(part,))
        acc = acc + part

    for i in gl.static_range(SLOTS):
        mbarrier.invalidate(bars.index(i))
    rm = off_m + gl.arange(0, TM, layout=gl.SliceLayout(1, mma_layout))
    rn = off_n + gl.arange(0, TN, layout=gl.SliceLayout(0, mma_layout))
    gl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def supported(*operands: torch.Tensor) -> bool:
    """The copy engine's constraints: K-contiguous operands, 16-byte-aligned base and rows."""
    return all(t.stride(1) == 1 and (t.stride(0) * 4) % 16 == 0 and t.data_ptr() % 16 == 0 for t in operands)


def gemm3(a: torch.Tensor, b_nk: torch.Tensor, blo_nk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b`` in 3xTF32, with B given K-major as ``b_nk [N, K]`` and its residual ``blo_nk``.

    ``out``: a row-major ``[M, N]`` fp32 tensor to write into (else a new one)."""
    M, K = a.shape
    N = b_nk.shape[0]
    if not supported(a, b_nk, blo_nk):
        raise ValueError("gluon gemm3 needs K-contiguous, 16-byte-aligned operands (K % 4 == 0)")
    c = torch.empty((M, N), device=a.device, dtype=torch.float32) if out is None else out
    assert c.shape == (M, N) and c.dtype == torch.float32 and c.stride(1) == 1, "out must be [M, N] fp32, row-major"
    a_layout = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float32)
    b_layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float32)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [BM, BK], a_layout)
    b_desc = TensorDescriptor(b_nk, list(b_nk.shape), list(b_nk.stride()), [BN, BK], b_layout)
    blo_desc = TensorDescriptor(blo_nk, list(blo_nk.shape), list(blo_nk.stride()), [BN, BK], b_layout)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    gemm3_kernel[grid](a_desc, b_desc, blo_desc, c, M, N, K, c.stride(0), GROUP=GROUP_M, SLOTS=STAGES,
                       num_warps=BM // 16)
    return c
