"""Grouped-query full attention with RoPE over a slotted KV cache.

The cache may store K / V as fp32, bf16, fp8 e4m3 or int8 (per layer, see
``refstack.model.cache``): new rows are encoded as they are written, and attention
reads every row back as stored, dequantized to fp32 (the new token's own row too, so a
prefill in one chunk or in several, and the native decode, all attend to the same keys).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infra_agent import tracing
from refstack.kernels import cpu_attention, cpu_blocks
from refstack.model.batch import ForwardBatch, PaddedPrefill
from refstack.model.cache import KVCodec, ModelCache
from refstack.model.config import HybridConfig
from refstack.model.layers import Linear


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [max_seq_len, head_dim // 2] (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D]; cos, sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class AttentionLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.split_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        self.qkv_proj = Linear(config.hidden_size, sum(self.split_sizes), gen)
        self.o_proj = Linear(
            self.num_heads * self.head_dim, config.hidden_size, gen, scale=1.0 / math.sqrt(2 * config.num_layers)
        )
        self.native = False  # see use_native

    def forward(self, x: Tensor, batch: ForwardBatch, cache: ModelCache) -> Tensor:
        with tracing.span("attention", cat="attn", layer=self.layer, tokens=batch.num_tokens):
            T = x.shape[0]
            qk, v = self.qkv_proj(x).split([sum(self.split_sizes[:2]), self.split_sizes[2]], dim=-1)
            assert batch.rope is not None, "the model sets the RoPE tables for the batch"
            cos, sin = batch.rope  # [T, head_dim / 2]: row t is token t's position
            # q and k heads are adjacent: rotate them together in one pass.
            if self.native:  # the decode block's own rotation, so both paths round alike
                qk = cpu_blocks.rope(qk, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin, torch.arange(T))
            else:
                qk = apply_rope(qk.reshape(T, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            v = v.reshape(T, self.num_kv_heads, self.head_dim)
            # The storage as the torch path indexes it, and how to encode into it and decode
            # out of it (None: fp32, stored and read as it is).
            keys, values = cache.kv_raw(self.layer)
            codec = cache.codecs.get(self.layer)
            nd = batch.num_decode
            parts: list[Tensor] = []
            if nd:
                parts.append(self._decode(q[:nd], k[:nd], v[:nd], batch, keys, values, codec, cache))
            if batch.padded_prefill is not None:
                p = slice(nd, T)
                parts.append(self._prefill_padded(q, k[p], v[p], batch.padded_prefill, keys, values, codec))
            else:
                for span in batch.prefills:
                    s = slice(span.begin, span.end)
                    parts.append(self._prefill(q[s], k[s], v[s], span.slot, span.start_pos, keys, values, codec))
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
            return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def use_native(self, on: bool) -> None:
        """Decode attention through ``cpu_attention.gqa_decode`` (the projections switch themselves)."""
        self.native = on

    def _decode(self, q: Tensor, k: Tensor, v: Tensor, batch: ForwardBatch, keys: Tensor, values: Tensor,
                codec: KVCodec | None, cache: ModelCache) -> Tensor:
        """All decode tokens at once; shorter sequences mask the padded tail."""
        if self.native:
            # The kernel encodes the new rows and dequantizes as it reads (any storage type).
            return cpu_attention.gqa_decode(q, k, v, cache.keys[self.layer], cache.values[self.layer], batch.decode_slots,
                                          batch.decode_positions, self.head_dim**-0.5,
                                          k_scale=cache.k_scales.get(self.layer), v_scale=cache.v_scales.get(self.layer))
        B = q.shape[0]
        pos = batch.decode_positions
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is [B, kv_heads, D].
        keys[batch.decode_slots, :, pos] = k if codec is None else codec.encode(k, 0)
        values[batch.decode_slots, :, pos] = v if codec is None else codec.encode(v, 1)
        L = batch.max_decode_len
        if batch.decode_slot_range is not None:
            lo, hi = batch.decode_slot_range
            k_ctx, v_ctx = keys[lo:hi, :, :L], values[lo:hi, :, :L]
        else:
            # Narrow to the longest live length first so the gather copies only that.
            k_ctx = keys[:, :, :L].index_select(0, batch.decode_slots)
            v_ctx = values[:, :, :L].index_select(0, batch.decode_slots)
        if codec is not None:  # attention reads what was stored (the new row too), in fp32
            k_ctx, v_ctx = codec.decode(k_ctx, 0), codec.decode(v_ctx, 1)
        # Grouped-query attention without expanding K/V: the query heads sharing a KV
        # head become rows of one small matmul.  (Faster on the CPU than SDPA for a
        # single query per sequence, and it never copies the cache per query head.)
        group = self.num_heads // self.num_kv_heads
        qg = q.view(B, self.num_kv_heads, group, self.head_dim)
        scores = (qg @ k_ctx.transpose(-1, -2)) * self.head_dim**-0.5  # [B, kv_heads, group, L]
        beyond = torch.arange(L, device=pos.device) > pos.unsqueeze(1)  # positions a shorter sequence has not written
        scores = scores.masked_fill(beyond.view(B, 1, 1, L), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v_ctx  # [B, kv_heads, group, D]
        return out.view(B, self.num_heads, self.head_dim)

    def _prefill(
        self, q: Tensor, k: Tensor, v: Tensor, slot: int, start: int, keys: Tensor, values: Tensor,
        codec: KVCodec | None = None,
    ) -> Tensor:
        """One sequence's chunk: causal over the cached prefix plus the chunk itself."""
        n = q.shape[0]
        end = start + n
        keys[slot, :, start:end] = (k if codec is None else codec.encode(k, 0)).transpose(0, 1)
        values[slot, :, start:end] = (v if codec is None else codec.encode(v, 1)).transpose(0, 1)
        k_ctx, v_ctx = keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end]
        if codec is not None:  # the chunk attends to its own keys as stored, as a later decode will
            k_ctx, v_ctx = codec.decode(k_ctx, 0), codec.decode(v_ctx, 1)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        if start == 0:
            out = F.scaled_dot_product_attention(qh, k_ctx, v_ctx, is_causal=True, enable_gqa=True)
        else:
            # Query i sits at position start + i and sees keys 0..start + i.
            keys_at, queries_at = torch.arange(end, device=q.device), torch.arange(start, end, device=q.device)
            mask = keys_at.unsqueeze(0) <= queries_at.unsqueeze(1)
            out = F.scaled_dot_product_attention(qh, k_ctx, v_ctx, attn_mask=mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)  # [n, heads, D]

    def _prefill_padded(
        self, q: Tensor, k: Tensor, v: Tensor, pp: PaddedPrefill, keys: Tensor, values: Tensor,
        codec: KVCodec | None = None,
    ) -> Tensor:
        """All prefill chunks at once: q from the whole stream, k/v of the prefill tokens."""
        keys[pp.token_slots, :, pp.token_positions] = k if codec is None else codec.encode(k, 0)
        values[pp.token_slots, :, pp.token_positions] = v if codec is None else codec.encode(v, 1)
        n = pp.index.shape[1]
        L = pp.max_len
        q_p = q[pp.index].transpose(1, 2)  # [S, heads, n_max, D]
        k_ctx = keys[:, :, :L].index_select(0, pp.slots)
        v_ctx = values[:, :, :L].index_select(0, pp.slots)
        if codec is not None:
            k_ctx, v_ctx = codec.decode(k_ctx, 0), codec.decode(v_ctx, 1)
        # Query i of chunk s sits at position start_s + i and sees keys up to there;
        # padded queries see something too (key 0), so no row is all -inf.
        query_pos = pp.starts.unsqueeze(1) + torch.arange(n, device=q.device).unsqueeze(0)  # [S, n_max]
        mask = torch.arange(L, device=q.device).view(1, 1, L) <= query_pos.unsqueeze(-1)
        out = F.scaled_dot_product_attention(q_p, k_ctx, v_ctx, attn_mask=mask.unsqueeze(1), enable_gqa=True)
        return out.transpose(1, 2)[pp.valid_at]  # [prefill tokens, heads, D]
