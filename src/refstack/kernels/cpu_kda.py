"""KDA's native calls: its activations from the projections, and its recurrence.

``cpu_kernels.c`` holds them:

- ``kda_prepare``: KDA's q/k normalisation, decay and beta from its projections, in one pass;
- ``kda_scan`` / ``kda_decode``: the KDA recurrence over T tokens of B equal-length
  sequences (or one token each), the states updated in place;
- ``kda_scan_varlen``: the same over a mixed step's sequences of any lengths, each with its
  own state slot (what the model's KDA layers run).

A whole KDA layer's decode step in one call is ``cpu_blocks.kda_decode_block``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refstack.kernels.cpu_build import load
from refstack.kernels.cpu_operands import check_fp32, check_index

__all__ = ["kda_decode", "kda_prepare", "kda_scan", "kda_scan_varlen"]


def kda_prepare(proj: Tensor, up: Tensor, dt_bias: Tensor, a_log: Tensor, heads: int, k_dim: int, v_dim: int,
                l2_weight: float, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KDA's activations from its projections, in one pass (see ``KDALayer.project``).

    proj [T, >= 2HK + HV + H] (q|k, v, b, ...); up [T, >= HK] (f before dt_bias, ...); rows
    may be strided, columns contiguous.  Returns contiguous q, k [T, H, K] (L2-normalised
    as ``rms_norm(x, eps) * l2_weight``), v [T, H, V], g [T, H, K]
    (``-exp(A_log) * softplus(f + dt_bias)``) and beta [T, H] (``sigmoid(b)``)."""
    check_fp32("kda_prepare", proj, up, dt_bias, a_log)
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
    check_fp32("kda_scan", q, k, v, g, beta, state)
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
    check_fp32("kda_scan_varlen", q, k, v, g, beta, states)
    check_index("kda_scan_varlen", begins, lengths, slots)
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
