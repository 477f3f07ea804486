"""Whole decode blocks in one native call each: a KDA layer, a full-attention layer, the
MoE router.  ``refstack.model.native_decode`` calls the C functions directly with
pointers it checked once; these wrappers check every argument, for tests and for
callers outside that path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refstack.kernels.cpu_build import load
from refstack.kernels.cpu_operands import check_fp32, check_index
from refstack.kernels.cpu_packs import NB, check_packed, fits, packed_k

__all__ = ["attn_decode_block", "attn_scratch_floats", "kda_decode_block", "kda_scratch_floats", "moe_route", "rope"]


def kda_scratch_floats(n_in: int, heads: int, k_dim: int, v_dim: int) -> int:
    """Scratch floats per token of ``refstack_kda_decode_block`` (proj, up, q, k, g, v,
    beta, o, gate, y), for a fused input projection ``n_in`` wide."""
    H, K, V = heads, k_dim, v_dim
    return n_in + (H * K + H * V) + 3 * H * K + 3 * H * V + H + H * V


def attn_scratch_floats(heads: int, kv_heads: int, head_dim: int) -> int:
    """Scratch floats per token of ``refstack_attn_decode_block`` (qkv, rotated q|k, v, o)."""
    return (3 * heads + 4 * kv_heads) * head_dim


def kda_decode_block(h: Tensor, in_proj: Tensor, low_rank: Tensor, dt_bias: Tensor, a_log: Tensor, state: Tensor,
                     o_norm_weight: Tensor, o_norm_eps: float, o_proj: Tensor, scale: float, l2_eps: float,
                     slots: Tensor | None = None) -> Tensor:
    """A KDA layer's decode step for B tokens in one call (``KDALayer`` with T = 1 each):
    ``in_proj`` / ``low_rank`` / ``o_proj`` packed by ``pack`` (all fp32 or all bf16);
    ``state`` [B, H, K, V] (contiguous) updated in place, or with ``slots`` [B] (int64,
    distinct) token b's state is ``state[slots[b]]``.  Returns the layer's output [B, D]."""
    check_fp32("kda_decode_block", h, dt_bias, a_log, state, o_norm_weight)
    check_packed("kda_decode_block", in_proj, low_rank, o_proj)
    bf16 = in_proj.dtype == torch.bfloat16
    B, D = h.shape
    _, H, K, V = state.shape
    n_up = H * K + H * V
    n_in_exact = 2 * H * K + H * V + H + packed_k(low_rank)
    if slots is not None:
        check_index("kda_decode_block", slots)
        if slots.shape != (B,) or (B and (int(slots.min()) < 0 or int(slots.max()) >= state.shape[0])) \
                or slots.unique().numel() != B:
            raise ValueError(f"kda_decode_block: slots must be {B} distinct indices into the {state.shape[0]} states")
        slots = slots.contiguous()
    if (slots is None and state.shape[0] != B) or not state.is_contiguous() or not fits(in_proj, D) or -(-n_in_exact // NB) != in_proj.shape[0] \
            or low_rank.dtype != in_proj.dtype or o_proj.dtype != in_proj.dtype \
            or low_rank.shape[0] != -(-n_up // NB) or not fits(o_proj, H * V) or o_proj.shape[0] != -(-D // NB) \
            or dt_bias.shape != (H * K,) or a_log.shape != (H,) or o_norm_weight.shape != (V,):
        raise ValueError(f"kda_decode_block: h {tuple(h.shape)}, state {tuple(state.shape)}, packed in_proj "
                         f"{tuple(in_proj.shape)} / low_rank {tuple(low_rank.shape)} / o_proj {tuple(o_proj.shape)} "
                         "do not fit one KDA layer")
    h = h.contiguous()
    out = torch.empty(B, D, dtype=h.dtype)
    scratch = torch.empty(B * kda_scratch_floats(n_in_exact, H, K, V), dtype=h.dtype)
    if load().refstack_kda_decode_block(h.data_ptr(), B, D, in_proj.data_ptr(), n_in_exact, low_rank.data_ptr(),
                                        dt_bias.contiguous().data_ptr(), a_log.contiguous().data_ptr(), K**-0.5, l2_eps,
                                        state.data_ptr(), H, K, V, scale, o_norm_weight.contiguous().data_ptr(),
                                        o_norm_eps, o_proj.data_ptr(), int(bf16), slots.data_ptr() if slots is not None else None,
                                        out.data_ptr(), scratch.data_ptr(),
                                        torch.get_num_threads()):
        raise ValueError(f"refstack_kda_decode_block rejected B={B} D={D} H={H} K={K} V={V}")
    return out


def attn_decode_block(h: Tensor, qkv_proj: Tensor, o_proj: Tensor, heads: int, kv_heads: int, head_dim: int,
                      rope_cos: Tensor, rope_sin: Tensor, keys: Tensor, values: Tensor, slots: Tensor, positions: Tensor,
                      scale: float) -> Tensor:
    """A full-attention layer's decode step for B tokens (``AttentionLayer`` with one token
    per sequence): ``qkv_proj`` / ``o_proj`` packed by ``pack`` (both fp32 or both bf16);
    RoPE from the tables [len, head_dim / 2] at ``positions``; k / v written into the
    cache (``keys``, ``values`` [slots, kv_heads, max_len, head_dim], in place) before
    attending.  Returns the layer's output [B, D]."""
    check_fp32("attn_decode_block", h, rope_cos, rope_sin, keys, values)
    check_packed("attn_decode_block", qkv_proj, o_proj)
    check_index("attn_decode_block", slots, positions)
    B, D = h.shape
    n_qkv, n_o = (heads + 2 * kv_heads) * head_dim, heads * head_dim
    cache_shape = (keys.shape[0], kv_heads, keys.shape[2] if keys.dim() == 4 else -1, head_dim)
    if o_proj.dtype != qkv_proj.dtype or not fits(qkv_proj, D) or qkv_proj.shape[0] != -(-n_qkv // NB) \
            or not fits(o_proj, n_o) or o_proj.shape[0] != -(-D // NB) or heads % kv_heads or head_dim % 2 \
            or rope_cos.shape != rope_sin.shape or rope_cos.dim() != 2 or rope_cos.shape[1] != head_dim // 2 \
            or keys.shape != cache_shape or values.shape != keys.shape or slots.shape != (B,) or positions.shape != (B,) \
            or not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError(f"attn_decode_block: h {tuple(h.shape)}, packed qkv {tuple(qkv_proj.shape)} / o {tuple(o_proj.shape)}, "
                         f"rope {tuple(rope_cos.shape)}, cache {tuple(keys.shape)}, slots {tuple(slots.shape)} do not fit "
                         f"{heads} heads / {kv_heads} kv heads of {head_dim}")
    h, slots, positions = h.contiguous(), slots.contiguous(), positions.contiguous()
    rope_cos, rope_sin = rope_cos.contiguous(), rope_sin.contiguous()
    out = torch.empty(B, D, dtype=h.dtype)
    if B == 0:
        return out
    scratch = torch.empty(B * attn_scratch_floats(heads, kv_heads, head_dim), dtype=h.dtype)
    rc = load().refstack_attn_decode_block(h.data_ptr(), B, D, qkv_proj.data_ptr(), o_proj.data_ptr(),
                                           int(qkv_proj.dtype == torch.bfloat16), heads, kv_heads, head_dim,
                                           rope_cos.data_ptr(), rope_sin.data_ptr(), rope_cos.shape[0], keys.data_ptr(),
                                           values.data_ptr(), slots.data_ptr(), positions.data_ptr(), keys.shape[0],
                                           keys.shape[2], scale, out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    if rc:
        raise ValueError(f"attn_decode_block: positions must be in [0, {min(keys.shape[2], rope_cos.shape[0])}) and slots in "
                         f"[0, {keys.shape[0]})" if rc == 2 else f"refstack_attn_decode_block rejected B={B} D={D}")
    return out


def moe_route(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """``refstack.model.moe.route`` in C: the top-k experts per token (ties to the lower id)
    and the softmax over their logits.  Returns ids [T, k] int64, weights [T, k]."""
    check_fp32("moe_route", router_logits)
    if router_logits.dim() != 2 or not 0 < top_k <= min(router_logits.shape[1], 64):
        raise ValueError(f"moe_route: logits {tuple(router_logits.shape)} with top_k={top_k}")
    logits = router_logits.contiguous()
    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int64)
    weights = torch.empty(T, top_k, dtype=logits.dtype)
    if load().refstack_moe_route(logits.data_ptr(), T, E, top_k, ids.data_ptr(), weights.data_ptr()):
        raise ValueError(f"refstack_moe_route rejected T={T} E={E} k={top_k}")
    return ids, weights


def rope(x: Tensor, heads: int, head_dim: int, rope_cos: Tensor, rope_sin: Tensor, positions: Tensor) -> Tensor:
    """RoPE (rotate-half) of the first ``heads`` heads of each row of x [T, >= heads * head_dim]
    (rows may be strided) at ``positions`` [T]; tables [len, head_dim / 2].  Returns
    [T, heads, head_dim].  The decode block rotates with the same C function."""
    check_fp32("rope", x, rope_cos, rope_sin)
    check_index("rope", positions)
    T = x.shape[0]
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < heads * head_dim or head_dim % 2 or positions.shape != (T,) \
            or rope_cos.shape != rope_sin.shape or rope_cos.dim() != 2 or rope_cos.shape[1] != head_dim // 2:
        raise ValueError(f"rope: x {tuple(x.shape)}, tables {tuple(rope_cos.shape)}, positions {tuple(positions.shape)} "
                         f"do not fit {heads} heads of {head_dim}")
    y = torch.empty(T, heads, head_dim, dtype=x.dtype)
    ldx = x.stride(0) if T > 1 else x.shape[1]
    rc = load().refstack_rope(x.data_ptr(), T, ldx, heads, head_dim, rope_cos.contiguous().data_ptr(),
                              rope_sin.contiguous().data_ptr(), rope_cos.shape[0], positions.contiguous().data_ptr(), y.data_ptr())
    if rc:
        raise ValueError(f"rope: positions must be in [0, {rope_cos.shape[0]})" if rc == 2 else
                         f"refstack_rope rejected T={T} heads={heads} head_dim={head_dim}")
    return y
