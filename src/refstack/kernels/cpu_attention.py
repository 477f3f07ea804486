"""Decode attention's native call: one query token per sequence against its slot of the KV cache.

``cpu_attention.c`` holds ``gqa_decode``: the new K/V rows written into the cache (fp32,
bf16, fp8 e4m3 or int8: new rows encoded, stored rows widened to fp32 as they are read),
then an online softmax over each sequence's own length.  ``kv_cache_args`` is how any
caller (this wrapper, ``refstack.model.native_decode``) turns a cache's storage into the
kernel's type code and scale pointers.  A whole attention layer's decode step in one call
is ``cpu_blocks.attn_decode_block``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refstack.kernels.cpu_build import load
from refstack.kernels.cpu_operands import check_fp32, check_index

__all__ = ["KV_TYPE_CODES", "gqa_decode", "kv_cache_args"]


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
    check_fp32("gqa_decode", q, k_new, v_new)
    check_index("gqa_decode", slots, positions)
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
