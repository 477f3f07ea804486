"""Native fp32 kernels for the CPU decode path: weight packing and the calls.

``cpu_kernels.c`` (built by ``cpu_build``) holds:

- ``gemm``: ``x @ W`` over a weight packed once into column blocks;
- ``moe_dispatch`` / ``moe_experts`` / ``moe_combine``: an MoE layer's routed copies
  grouped by expert (a counting sort), its SwiGLU expert pairs (gate/up, silu, down)
  over those rows, all experts in one call, and the weighted sum back per token;
- ``ep_dispatch`` / ``ep_combine``: the same dispatch and combine as an expert-parallel
  library's native section, with a modelled, bounded wait for the peer ranks
  (``ep_wait``: the bytes that cross ranks, ``ep_cross_bytes``, over the link); each
  call releases the GIL (``load()``, a ``CDLL``) or holds it (``load_holding_gil()``, a
  ``PyDLL``), per its ``release_gil`` argument;
- ``gqa_decode``: one query token per sequence against its slot of the KV cache (fp32,
  bf16, fp8 e4m3 or int8: new rows encoded, stored rows widened to fp32 as they are read);
- ``rms_norm``: RMSNorm, optionally after a residual add or with a sigmoid gate;
- ``kda_prepare``: KDA's q/k normalisation, decay, beta from its projections;
- ``kda_scan`` / ``kda_decode``: the KDA recurrence over T tokens of B equal-length
  sequences (or one token each), the states updated in place; ``kda_scan_varlen``: the
  same over a mixed step's sequences of any lengths, each with its own state slot
  (what the model's KDA layers run).

Whole decode blocks (a KDA layer, an attention layer, the router) are in ``cpu_blocks``.

Decode multiplies a handful of rows by every weight, the shape where MKL's sgemm is
slowest: on the 2-core AVX-512 bench box it streams a 1 MiB weight at 4-10 GB/s for
1-32 rows, the packed kernel at 12-30 GB/s (``bench/cpu_kernels.py``).  The other
kernels replace chains of small tensor ops whose per-op cost dominates at decode.
Results match torch to fp32 rounding, not bit for bit (different summation order);
a row's result never depends on the other rows in the call.

Every packing function takes ``dtype``: ``torch.float32``, or ``torch.bfloat16`` for
the bf16 GEMMs of ``cpu_bf16.c`` (weights rounded to bf16 when packed, activations
rounded to bf16 inside the call, fp32 accumulation): ``gemm``, ``moe_experts`` and
``kda_decode_block`` pick the kernel from the packed weights' dtype.

W8A8 (``cpu_int8.c``, ``refstack.model.quant``): ``pack_w8a8`` / ``pack_gate_up_w8a8`` /
``pack_down_w8a8`` build *tagged* packs (``cpu_packs`` defines every layout, these included);
``gemm`` and ``moe_experts`` take them too; ``gemm_kind`` is the kind number the native decode
blocks take (0 fp32, 1 bf16, 2 tagged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from refstack.kernels.cpu_build import (
    NativeKernelsUnavailable,
    available,
    load,
    load_holding_gil,
    unavailable_reason,
)

# The layouts live in cpu_packs; they are this module's API too (callers pack and call here).
from refstack.kernels.cpu_packs import (
    FORMAT_W8A8,
    HALF,
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
    "ep_combine",
    "ep_cross_bytes",
    "ep_dispatch",
    "ep_wait",
    "gemm",
    "gemm_kind",
    "gqa_decode",
    "int8_dot_native",
    "int8_mm",
    "int8_portable",
    "int8_quantize",
    "kda_decode",
    "kda_prepare",
    "kda_scan",
    "kda_scan_varlen",
    "kv_cache_args",
    "load",
    "moe_combine",
    "moe_dispatch",
    "moe_experts",
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


def _check(name: str, *tensors: Tensor) -> None:
    """fp32 CPU tensors (every float operand)."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name}: the native kernels take fp32 CPU tensors, got {t.dtype} on {t.device}")


def _check_index(name: str, *tensors: Tensor) -> None:
    """int64 CPU tensors (every index operand: another device's pointer must never reach C)."""
    for t in tensors:
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"{name}: index tensors must be int64 on the CPU, got {t.dtype} on {t.device}")





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
    _check("int8_quantize", x, *(t for t in (inv_s,) if t is not None))
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
    _check("gemm", x)
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


def _moe_experts_w8a8(rows: Tensor, counts: list[int], gate_up: Tensor, down: Tensor) -> Tensor:
    h1, h2 = read_header(gate_up), read_header(down)
    D, inner, E = h1["K"], h1["N"] // 2, len(counts)
    if rows.dim() != 2 or rows.shape[1] != D or (h2["K"], h2["N"]) != (inner, D) or sum(counts) != rows.shape[0] \
            or gate_up.numel() != E * h1["total"] or down.numel() != E * h2["total"]:
        raise ValueError(f"moe_experts: rows {tuple(rows.shape)}, {E} counts, W8A8 packs of {gate_up.numel()} / "
                         f"{down.numel()} bytes (D={D}, I={inner}) do not match")
    rows = rows.contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return y
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum_(0)
    hidden = torch.empty(rows.shape[0], inner, dtype=rows.dtype)
    if load().refstack_moe_experts_w8a8(rows.data_ptr(), offsets.data_ptr(), E, D, inner, gate_up.data_ptr(),
                                        down.data_ptr(), hidden.data_ptr(), y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"refstack_moe_experts_w8a8 rejected E={E} D={D} I={inner} counts={counts}")
    return y


def moe_experts(rows: Tensor, counts: list[int], gate_up: Tensor, down: Tensor) -> Tensor:
    """SwiGLU experts over ``rows`` [n, D] grouped by expert, ``counts`` rows per expert.

    ``gate_up`` from ``pack_gate_up``, ``down`` from ``pack_down`` (both fp32 or both
    bf16); returns [n, D]."""
    _check("moe_experts", rows)
    check_packed("moe_experts", gate_up, down)
    if is_tagged(gate_up) and is_tagged(down):  # W8A8: pack_gate_up_w8a8 / pack_down_w8a8
        return _moe_experts_w8a8(rows, counts, gate_up, down)
    bf16 = gate_up.dtype == torch.bfloat16
    dims = 5 if bf16 else 4
    if gate_up.dim() != dims or down.dim() != dims or down.dtype != gate_up.dtype:
        raise ValueError(f"moe_experts: packed weights {gate_up.dtype} {tuple(gate_up.shape)} / {down.dtype} "
                         f"{tuple(down.shape)} must both be {dims}-d of one dtype")
    E, n_blocks = gate_up.shape[:2]
    inner = n_blocks * HALF
    D = rows.shape[1] if rows.dim() == 2 else -1
    if len(counts) != E or sum(counts) != rows.shape[0] or not fits(gate_up, D) or not fits(down, inner) \
            or down.shape[:2] != (E, -(-D // NB)):
        raise ValueError(f"moe_experts: rows {tuple(rows.shape)}, {len(counts)} counts, packed {tuple(gate_up.shape)} "
                         f"/ {tuple(down.shape)} do not match")
    rows = rows.contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return y
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum_(0)
    h = torch.empty(rows.shape[0], inner, dtype=rows.dtype)
    kernel = load().refstack_moe_experts_bf16 if bf16 else load().refstack_moe_experts
    if kernel(rows.data_ptr(), offsets.data_ptr(), E, D, inner, gate_up.data_ptr(), down.data_ptr(), h.data_ptr(),
              y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"refstack_moe_experts rejected E={E} D={D} I={inner} counts={counts}")
    return y


def moe_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int
                 ) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """Routed copies grouped by expert (stable in token order), rows gathered.

    Returns (rows [T*k, D] in expert order, counts per expert, copy_slot [T, k]: the row
    of each (token, choice) copy, token_ids [T*k] and weights [T*k] in expert order)."""
    return _dispatch("moe_dispatch", load().refstack_moe_dispatch, x, topk_ids, topk_weights, num_experts)


def _dispatch(name: str, fn: Any, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int,
              *extra: Any) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """The shared body of ``moe_dispatch`` and ``ep_dispatch``: checks, buffers, the C call
    ``fn`` (``extra``: its arguments after the thread count)."""
    _check(name, x, topk_weights)
    _check_index(name, topk_ids)
    T, k = topk_ids.shape
    if x.dim() != 2 or x.shape[0] != T or topk_weights.shape != (T, k):
        raise ValueError(f"{name}: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}, "
                         f"topk_weights {tuple(topk_weights.shape)} do not match")
    x, ids, w = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    D = x.shape[1]
    counts = torch.empty(num_experts, dtype=torch.int64)
    rows = torch.empty(T * k, D, dtype=x.dtype)
    slot = torch.empty(T, k, dtype=torch.int64)
    token_ids = torch.empty(T * k, dtype=torch.int64)
    weights = torch.empty(T * k, dtype=x.dtype)
    rc = fn(x.data_ptr(), T, D, ids.data_ptr(), w.data_ptr(), k, num_experts, counts.data_ptr(), rows.data_ptr(),
            slot.data_ptr(), token_ids.data_ptr(), weights.data_ptr(), None, torch.get_num_threads(), *extra)
    if rc:
        raise ValueError(f"{name}: expert ids must be in [0, {num_experts})" if rc == 2 else
                         f"refstack_{name} rejected T={T} D={D} k={k} E={num_experts}")
    return rows, counts.tolist(), slot, token_ids, weights


def _ep_lib(release_gil: bool) -> Any:  # a ctypes library handle: CDLL or PyDLL
    return load() if release_gil else load_holding_gil()


def ep_cross_bytes(topk_ids: Tensor, num_experts: int, ep_ranks: int, hidden: int) -> int:
    """Bytes of token rows that cross ranks in a dispatch (and come back in the combine):
    token t lives on rank ``t * ep_ranks // T`` (contiguous shards), a copy goes to the
    rank owning its expert (``expert // (num_experts / ep_ranks)``); fp32 rows."""
    _check_index("ep_cross_bytes", topk_ids)
    T, k = topk_ids.shape
    ids = topk_ids.contiguous()
    return int(load().refstack_ep_cross_bytes(ids.data_ptr(), T, k, num_experts, ep_ranks, hidden))


def ep_wait(nbytes: int, ns_per_byte: float, *, release_gil: bool = True) -> int:
    """Wait ``nbytes * ns_per_byte`` ns (at most 50 ms) in C; returns the ns waited."""
    return int(_ep_lib(release_gil).refstack_ep_wait(nbytes, ns_per_byte))


def ep_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int, cross_bytes: int,
                ns_per_byte: float, *, release_gil: bool = True) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """``moe_dispatch`` as one native section that then waits ``cross_bytes * ns_per_byte`` ns
    for the peers; through the GIL-holding handle when ``release_gil`` is False."""
    return _dispatch("ep_dispatch", _ep_lib(release_gil).refstack_ep_dispatch, x, topk_ids, topk_weights, num_experts,
                     cross_bytes, ns_per_byte)


def ep_combine(out: Tensor, copy_slot: Tensor, copy_weights: Tensor, cross_bytes: int, ns_per_byte: float, *,
               release_gil: bool = True) -> Tensor:
    """``moe_combine`` as one native section that first waits ``cross_bytes * ns_per_byte`` ns
    for the expert outputs to come back; through the GIL-holding handle when ``release_gil`` is False."""
    return _combine("ep_combine", _ep_lib(release_gil).refstack_ep_combine, out, copy_slot, copy_weights,
                    cross_bytes, ns_per_byte)


def moe_combine(out: Tensor, copy_slot: Tensor, copy_weights: Tensor) -> Tensor:
    """``y[t] = sum_j copy_weights[t, j] * out[copy_slot[t, j]]``, in each token's own top-k order."""
    return _combine("moe_combine", load().refstack_moe_combine, out, copy_slot, copy_weights)


def _combine(name: str, fn: Any, out: Tensor, copy_slot: Tensor, copy_weights: Tensor, *extra: Any) -> Tensor:
    """The shared body of ``moe_combine`` and ``ep_combine`` (``extra``: the C call's
    arguments after the thread count)."""
    _check(name, out, copy_weights)
    _check_index(name, copy_slot)
    T, k = copy_slot.shape
    if out.dim() != 2 or copy_weights.shape != (T, k):
        raise ValueError(f"{name}: out {tuple(out.shape)}, copy_slot {tuple(copy_slot.shape)}, "
                         f"copy_weights {tuple(copy_weights.shape)} do not match")
    out, slot, w = out.contiguous(), copy_slot.contiguous(), copy_weights.contiguous()
    y = torch.empty(T, out.shape[1], dtype=out.dtype)
    rc = fn(out.data_ptr(), out.shape[0], slot.data_ptr(), w.data_ptr(), T, k, out.shape[1], y.data_ptr(), 0,
            torch.get_num_threads(), *extra)
    if rc:
        raise ValueError(f"{name}: copy_slot must index the {out.shape[0]} rows of out" if rc == 2 else
                         f"refstack_{name} rejected T={T} k={k} D={out.shape[1]}")
    return y


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, residual_delta: Tensor | None = None,
             gate: Tensor | None = None) -> Tensor:
    """RMSNorm over the last dim of ``x``, times ``sigmoid(gate)`` when given.

    With ``residual_delta``, ``x += residual_delta`` first, in place (``x`` must then be
    contiguous): the fused residual add of a pre-norm block.  Returns the normalised rows."""
    _check("rms_norm", x, weight, *(t for t in (residual_delta, gate) if t is not None))
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


def kda_prepare(proj: Tensor, up: Tensor, dt_bias: Tensor, a_log: Tensor, heads: int, k_dim: int, v_dim: int,
                l2_weight: float, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KDA's activations from its projections, in one pass (see ``KDALayer.project``).

    proj [T, >= 2HK + HV + H] (q|k, v, b, ...); up [T, >= HK] (f before dt_bias, ...); rows
    may be strided, columns contiguous.  Returns contiguous q, k [T, H, K] (L2-normalised
    as ``rms_norm(x, eps) * l2_weight``), v [T, H, V], g [T, H, K]
    (``-exp(A_log) * softplus(f + dt_bias)``) and beta [T, H] (``sigmoid(b)``)."""
    _check("kda_prepare", proj, up, dt_bias, a_log)
    H, K, V = heads, k_dim, v_dim
    T = proj.shape[0]
    if proj.dim() != 2 or up.dim() != 2 or up.shape[0] != T or proj.stride(1) != 1 or up.stride(1) != 1 \
            or dt_bias.shape != (H * K,) or a_log.shape != (H,) or proj.shape[1] < 2 * H * K + H * V + H or up.shape[1] < H * K:
        raise ValueError(f"kda_prepare: proj {tuple(proj.shape)}, up {tuple(up.shape)}, dt_bias {tuple(dt_bias.shape)}, "
                         f"A_log {tuple(a_log.shape)} do not fit H={H} K={K} V={V}")
    q, k, g = (torch.empty(T, H, K, dtype=proj.dtype) for _ in range(3))
    v = torch.empty(T, H, V, dtype=proj.dtype)
    beta = torch.empty(T, H, dtype=proj.dtype)
    dt_bias, a_log = dt_bias.contiguous(), a_log.contiguous()
    if load().refstack_kda_prepare(proj.data_ptr(), proj.stride(0), up.data_ptr(), up.stride(0), dt_bias.data_ptr(),
                                   a_log.data_ptr(), l2_weight, eps, T, H, K, V, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                   g.data_ptr(), beta.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"refstack_kda_prepare rejected T={T} H={H} K={K} V={V}")
    return q, k, v, g, beta


def kda_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float) -> Tensor:
    """KDA over T tokens of B sequences, token by token (the recurrent form).

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; ``state`` [B, H, K, V] is the
    state before the first token, updated in place (it must be contiguous).  Returns
    o [B, T, H, V].  Positions with k = 0 and g = 0 leave the state as it is (padding).
    """
    _check("kda_scan", q, k, v, g, beta, state)
    B, H, K, V = state.shape
    T = q.shape[1] if q.dim() == 4 else -1
    if q.shape != (B, T, H, K) or k.shape != q.shape or g.shape != q.shape or v.shape != (B, T, H, V) \
            or beta.shape != (B, T, H):
        raise ValueError(f"kda_scan: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)} do not fit a state {tuple(state.shape)}")
    if not state.is_contiguous():
        raise ValueError("kda_scan: the state is updated in place and must be contiguous")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=q.dtype)
    if load().refstack_kda_scan(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                state.data_ptr(), None, B, T, H, K, V, scale, o.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"refstack_kda_scan rejected B={B} T={T} H={H} K={K} V={V}")
    return o


def kda_scan_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor, begins: Tensor,
                    lengths: Tensor, slots: Tensor, fresh: Tensor, scale: float) -> Tensor:
    """KDA over several sequences of one token stream, each from its own state slot.

    q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; ``states`` [num_slots, H, K, V]
    (contiguous, updated in place).  Sequence i is rows ``begins[i] : begins[i] +
    lengths[i]`` and state ``states[slots[i]]``, zeroed first where ``fresh[i]``; the
    slots must be distinct and the row ranges disjoint (checked: ``ValueError``).
    Returns o [N, H, V] (zero in rows no sequence covers).
    One call for a whole mixed step: no padding, and no gather or scatter of states.
    """
    _check("kda_scan_varlen", q, k, v, g, beta, states)
    _check_index("kda_scan_varlen", begins, lengths, slots)
    num_slots, H, K, V = states.shape
    N, n = q.shape[0], begins.shape[0]
    if q.shape != (N, H, K) or k.shape != q.shape or g.shape != q.shape or v.shape != (N, H, V) or beta.shape != (N, H):
        raise ValueError(f"kda_scan_varlen: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)} do not fit states {tuple(states.shape)}")
    if lengths.shape != (n,) or slots.shape != (n,) or fresh.shape != (n,) or fresh.dtype != torch.bool \
            or fresh.device.type != "cpu":
        raise ValueError(f"kda_scan_varlen: begins {tuple(begins.shape)}, lengths {tuple(lengths.shape)}, slots "
                         f"{tuple(slots.shape)} and fresh {tuple(fresh.shape)} {fresh.dtype} must be [n]; fresh bool")
    if not states.is_contiguous():
        raise ValueError("kda_scan_varlen: the states are updated in place and must be contiguous")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    begins, lengths, slots, fresh = (t.contiguous() for t in (begins, lengths, slots, fresh))
    o = torch.zeros(N, H, V, dtype=q.dtype)
    rc = load().refstack_kda_scan_varlen(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                         states.data_ptr(), num_slots, begins.data_ptr(), lengths.data_ptr(),
                                         slots.data_ptr(), fresh.data_ptr(), n, N, H, K, V, scale, o.data_ptr(),
                                         torch.get_num_threads())
    if rc == 3:
        raise MemoryError("refstack_kda_scan_varlen could not allocate its checks")
    if rc:
        raise ValueError(f"refstack_kda_scan_varlen rejected the sequences (rows out of range or overlapping, a slot "
                         f"out of range or repeated): begins {begins.tolist()}, lengths {lengths.tolist()}, slots "
                         f"{slots.tolist()} for {N} rows and {num_slots} slots")
    return o


def kda_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float) -> Tensor:
    """One decode step (``kda_scan`` with T = 1): q, k, g [B, H, K]; v [B, H, V]; beta [B, H]."""
    return kda_scan(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state, scale)[:, 0]


# The cache storage types the decode attention kernel reads (its kv_type argument).
KV_TYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 3}
if hasattr(torch, "float8_e4m3fn"):
    KV_TYPE_CODES[torch.float8_e4m3fn] = 2


def kv_cache_args(name: str, keys: Tensor, values: Tensor, k_scale: Tensor | None,
                  v_scale: Tensor | None) -> tuple[int, int | None, int | None]:
    """The kernel's (kv_type, K scales pointer, V scales pointer) for a cache's K / V
    storage: contiguous CPU tensors of one type in ``KV_TYPE_CODES``; fp8 and int8 need
    their scales ([kv_heads] fp32 CPU, stored value * scale = the value)."""
    code = KV_TYPE_CODES.get(keys.dtype)
    if code is None or values.dtype != keys.dtype or keys.device.type != "cpu" or values.device.type != "cpu" \
            or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"{name}: the cache must be contiguous CPU tensors of one of "
                         f"{[str(d) for d in KV_TYPE_CODES]}, got {keys.dtype} / {values.dtype} on {keys.device}")
    if code not in (2, 3):
        return code, None, None
    heads = keys.shape[1]
    for t in (k_scale, v_scale):
        if t is None or t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != (heads,) or not t.is_contiguous():
            raise ValueError(f"{name}: a {keys.dtype} cache needs K and V scales of [{heads}] fp32 on the CPU, got "
                             f"{None if t is None else (t.dtype, tuple(t.shape))}")
    assert k_scale is not None and v_scale is not None
    return code, k_scale.data_ptr(), v_scale.data_ptr()


def gqa_decode(q: Tensor, k_new: Tensor, v_new: Tensor, keys: Tensor, values: Tensor, slots: Tensor, positions: Tensor,
               scale: float, *, k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """One query token per sequence: write k_new / v_new into the cache at ``positions``,
    then attend over positions 0..pos of the sequence's slot.

    q [B, Hq, D]; k_new, v_new [B, Hkv, D]; keys, values [slots, Hkv, max_len, D]
    (contiguous, written in place; fp32, bf16, float8_e4m3fn or int8, the last two with
    ``k_scale`` / ``v_scale`` [Hkv]: new rows are stored as ``x / scale`` rounded, read
    back times the scale); slots, positions [B] int64.  Returns [B, Hq, D] (fp32)."""
    _check("gqa_decode", q, k_new, v_new)
    _check_index("gqa_decode", slots, positions)
    kv_type, k_scale_ptr, v_scale_ptr = kv_cache_args("gqa_decode", keys, values, k_scale, v_scale)
    B, Hq, D = q.shape
    n_slots, Hkv, max_len, _ = keys.shape
    if k_new.shape != (B, Hkv, D) or v_new.shape != k_new.shape or values.shape != keys.shape or keys.shape[-1] != D \
            or Hq % Hkv or slots.shape != (B,) or positions.shape != (B,):
        raise ValueError(f"gqa_decode: q {tuple(q.shape)}, k/v {tuple(k_new.shape)}, cache {tuple(keys.shape)}, "
                         f"slots {tuple(slots.shape)}, positions {tuple(positions.shape)} do not match")
    if B == 0:
        return torch.empty_like(q)
    q, k_new, v_new, slots, positions = (t.contiguous() for t in (q, k_new, v_new, slots, positions))
    out = torch.empty_like(q)
    rc = load().refstack_gqa_decode_kv(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), keys.data_ptr(),
                                       values.data_ptr(), kv_type, k_scale_ptr, v_scale_ptr, slots.data_ptr(),
                                       positions.data_ptr(), B, n_slots, Hkv, Hq // Hkv, max_len, D, scale, out.data_ptr(),
                                       torch.get_num_threads())
    if rc:
        raise ValueError(f"gqa_decode: positions must be in [0, {max_len}) and slots in [0, {n_slots})" if rc == 2 else
                         f"refstack_gqa_decode rejected B={B} Hkv={Hkv} D={D}")
    return out
