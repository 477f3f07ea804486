"""Per-sequence memory, addressed by slot: KV caches and KDA recurrent states.

Storage types (see ``refstack.model.kv_dtypes`` for the knobs and docs/refstack.md,
"KV cache and state precision"):

- each attention layer's K and V are stored as fp32, bf16 (a plain round to nearest
  even), fp8 e4m3 (``torch.float8_e4m3fn``) or int8; the last two with a scale per
  (layer, KV head) for K and one for V, fixed when the cache is made from a calibration
  pass over a seeded prompt set (``calibrate_kv_amax``): values beyond the calibrated
  range saturate.  Attention reads dequantize to fp32 (``KVCodec.decode``, or the
  native kernel's own read) and compute in fp32;
- each KDA layer's recurrent state is fp32 or bf16 (read as fp32, updated in fp32,
  rounded back to bf16 after every step).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from refstack.model.batch import SeqChunk
from refstack.model.config import HybridConfig
from refstack.model.kv_dtypes import KV_DTYPES, SCALED, STATE_DTYPES, footprint

# The largest stored magnitude of the scaled types: int8 keeps +-127 (symmetric, -128
# unused), e4m3fn's largest finite value is 448 (torch's cast would make larger values NaN).
QMAX: dict[str, float] = {"int8": 127.0, "fp8_e4m3": 448.0}
# The calibrated amax maps to QMAX / HEADROOM: room for values a little beyond what the
# calibration prompts produced before they saturate.  int8 pays for it in resolution
# (its step is amax * HEADROOM / 127); e4m3 keeps its relative precision at any scale,
# so it takes more room for free.
HEADROOM: dict[str, float] = {"int8": 1.25, "fp8_e4m3": 2.0}


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a KV / state storage type name."""
    if name == "fp8_e4m3":
        f8 = getattr(torch, "float8_e4m3fn", None)
        if f8 is None:
            raise ValueError(f"kv cache dtype fp8_e4m3: this torch ({torch.__version__}) has no float8_e4m3fn type")
        return f8  # type: ignore[no-any-return]
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[name]


@dataclass(frozen=True, slots=True)
class KVCodec:
    """One attention layer's non-fp32 K/V storage: encode fp32 rows, decode stored ones.

    ``encode`` takes K or V rows [..., kv_heads, head_dim] (heads on dim -2, as the
    projections give them); ``decode`` takes stored blocks [..., kv_heads, L, head_dim]
    (the cache's layout).  fp8 goes through uint8 views (``ModelCache.kv_raw``): indexing
    ops on bytes exist on every device, float8 ones not everywhere.
    """

    dtype: str  # "bf16", "fp8_e4m3" or "int8"
    k_scale: Tensor  # [kv_heads] fp32 (ones for bf16)
    v_scale: Tensor

    def encode(self, x: Tensor, which: int) -> Tensor:
        """fp32 rows as stored (``which``: 0 keys, 1 values)."""
        if self.dtype == "bf16":
            return x.to(torch.bfloat16)
        scale = (self.k_scale if which == 0 else self.v_scale).view(-1, 1)
        q = x / scale
        if self.dtype == "int8":
            return q.round_().clamp_(-127.0, 127.0).to(torch.int8)
        return q.clamp_(-448.0, 448.0).to(storage_dtype("fp8_e4m3")).view(torch.uint8)

    def decode(self, stored: Tensor, which: int) -> Tensor:
        """Stored blocks [..., kv_heads, L, D] as fp32."""
        if self.dtype == "bf16":
            return stored.float()
        if self.dtype == "fp8_e4m3":
            stored = stored.view(storage_dtype("fp8_e4m3"))
        scale = (self.k_scale if which == 0 else self.v_scale).view(-1, 1, 1)
        return stored.float().mul_(scale)


class ModelCache:
    """KV slots for the attention layers and state slots for the KDA layers.

    A slot belongs to one sequence at a time; the engine allocates slots and calls
    :meth:`reset_slot` when it hands one to a new sequence.  (The model also ignores
    stale contents at ``start_pos == 0``, so a forgotten reset cannot leak a previous
    sequence into a new one.)

    ``kv_dtypes`` ({attention layer: "fp32" | "bf16" | "fp8_e4m3" | "int8"}, missing
    layers fp32) needs ``kv_amax`` ({layer: (K amax [kv_heads], V amax [kv_heads])},
    from ``calibrate_kv_amax``) for its fp8 / int8 layers; ``state_dtype`` is the KDA
    states' ("fp32" or "bf16").
    """

    def __init__(self, config: HybridConfig, num_slots: int, max_seq_len: int | None = None,
                 device: torch.device | str = "cpu", *, kv_dtypes: Mapping[int, str] | None = None,
                 kv_amax: Mapping[int, tuple[Tensor, Tensor]] | None = None, state_dtype: str = "fp32") -> None:
        max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if num_slots <= 0:
            raise ValueError(f"ModelCache: num_slots must be positive, got {num_slots}")
        if not 0 < max_seq_len <= config.max_seq_len:
            raise ValueError(
                f"ModelCache: max_seq_len must be in 1..{config.max_seq_len} (the config's), got {max_seq_len}"
            )
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"ModelCache: state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
        kv_dtypes = dict(kv_dtypes or {})
        for layer, name in kv_dtypes.items():
            if layer not in config.full_attention_layers or name not in KV_DTYPES:
                raise ValueError(f"ModelCache: kv_dtypes {{{layer}: {name!r}}}: expected an attention layer "
                                 f"{config.full_attention_layers} and one of {KV_DTYPES}")
            if name in SCALED and (kv_amax is None or layer not in kv_amax):
                raise ValueError(f"ModelCache: layer {layer} stores {name}, which needs its calibrated kv_amax")
        self.config = config
        self.device = torch.device(device)  # the model's: every layer reads and writes these in place
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.kv_dtypes: dict[int, str] = {layer: kv_dtypes.get(layer, "fp32") for layer in config.full_attention_layers}
        self.state_dtype = state_dtype
        # Layout [slot, kv_head, position, head_dim]: a slot's prefix [:, :L] is what
        # scaled_dot_product_attention takes directly, without a transpose copy.
        kv_shape = (num_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        state_shape = (num_slots, config.kda_num_heads, config.kda_head_k_dim, config.kda_head_v_dim)
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.states: dict[int, Tensor] = {}
        # Scales of the fp8 / int8 layers, [kv_heads] fp32: stored value * scale = fp32 value.
        self.k_scales: dict[int, Tensor] = {}
        self.v_scales: dict[int, Tensor] = {}
        self.codecs: dict[int, KVCodec] = {}  # every non-fp32 attention layer's
        for layer in range(config.num_layers):
            if config.is_full_attention(layer):
                name = self.kv_dtypes[layer]
                dtype = storage_dtype(name)
                self.keys[layer] = torch.zeros(kv_shape, dtype=dtype, device=self.device)
                self.values[layer] = torch.zeros(kv_shape, dtype=dtype, device=self.device)
                if name in SCALED:
                    assert kv_amax is not None
                    k_amax, v_amax = kv_amax[layer]
                    self.k_scales[layer] = _scale(k_amax, name).to(self.device)
                    self.v_scales[layer] = _scale(v_amax, name).to(self.device)
                if name != "fp32":
                    ones = torch.ones(config.num_kv_heads, device=self.device)
                    self.codecs[layer] = KVCodec(name, self.k_scales.get(layer, ones), self.v_scales.get(layer, ones))
            else:
                self.states[layer] = torch.zeros(state_shape, dtype=storage_dtype(state_dtype), device=self.device)

    def kv_raw(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's K and V storage as the torch path indexes it (fp8 as uint8 views)."""
        keys, values = self.keys[layer], self.values[layer]
        if self.kv_dtypes[layer] == "fp8_e4m3":
            return keys.view(torch.uint8), values.view(torch.uint8)
        return keys, values

    def reset_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"reset_slot: slot {slot} outside 0..{self.num_slots - 1}")
        # Only the recurrent state needs clearing: attention masks never read KV
        # positions a sequence has not written.
        with torch.inference_mode():
            for state in self.states.values():
                state[slot].zero_()

    def reset(self) -> None:
        for slot in range(self.num_slots):
            self.reset_slot(slot)

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.states.values(),
                   *self.k_scales.values(), *self.v_scales.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def bytes_per_slot(self) -> int:
        return self.nbytes // self.num_slots

    def footprint(self) -> dict[str, Any]:
        """Bytes per token (attention KV) and per sequence (KDA states), sequences per GiB
        (see ``kv_dtypes.footprint``)."""
        return footprint(self.config, self.kv_dtypes, self.state_dtype, self.max_seq_len)


def _scale(amax: Tensor, name: str) -> Tensor:
    """A per-head scale that maps the calibrated amax to QMAX / HEADROOM (never zero)."""
    return (amax.float().clamp(min=1e-6) * (HEADROOM[name] / QMAX[name])).contiguous()


# ---------------------------------------------------------------- calibration
# English text and seeded random bytes: the tokenizer is byte-level, and the random
# model's activations depend on which bytes come, not on meaning.
_CALIBRATION_TEXTS = (
    "The quick brown fox jumps over the lazy dog while the cache keeps every key.",
    "def forward(self, x):\n    return self.o_proj(attention(self.q(x), self.k(x), self.v(x)))\n",
    "Q: How many sequences fit in memory? A: bytes per token times tokens per sequence.",
    '{"model": "tiny", "prompt": "hello", "max_tokens": 16, "temperature": 0.0}',
)
CALIBRATION_TOKENS = 64  # per prompt
CALIBRATION_RANDOM_PROMPTS = 4
# Per model, per weight quantisation (W8A8 changes the projections the keys come from).
_calibrated: weakref.WeakKeyDictionary[Any, dict[str, dict[int, tuple[Tensor, Tensor]]]] = weakref.WeakKeyDictionary()


def calibration_prompts(max_len: int) -> list[list[int]]:
    """The calibration prompt set: each text repeated to ``CALIBRATION_TOKENS`` bytes, and
    random byte strings from a fixed seed (the same set every time)."""
    n = min(CALIBRATION_TOKENS, max_len)
    prompts = [list((text * (n // len(text) + 1)).encode()[:n]) for text in _CALIBRATION_TEXTS]
    gen = torch.Generator().manual_seed(0x4B56)
    prompts += torch.randint(0, 256, (CALIBRATION_RANDOM_PROMPTS, n), generator=gen).tolist()
    return prompts


def calibrate_kv_amax(model: Any) -> dict[int, tuple[Tensor, Tensor]]:
    """Per attention layer, the largest |K| and |V| per KV head over the calibration
    prompts, prefilled through ``model`` into a scratch fp32 cache (once per model and
    weight quantisation).

    K's bound is the largest RoPE pair norm, ``hypot(k[i], k[i + D/2])``: the rotation
    keeps each pair's norm, so the bound holds for a key at any position, not only at the
    positions the prompts reached."""
    memo = _calibrated.setdefault(model, {})
    weights = str(getattr(model, "quantization", "none"))
    if weights in memo:
        return memo[weights]
    config: HybridConfig = model.config
    prompts = calibration_prompts(config.max_seq_len)
    cache = ModelCache(config, num_slots=len(prompts), max_seq_len=len(prompts[0]), device=model.device)
    with torch.inference_mode():
        model.forward_chunks([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], cache)
        half = config.head_dim // 2
        out: dict[int, tuple[Tensor, Tensor]] = {}
        for layer, keys in cache.keys.items():
            pair_norm = torch.hypot(keys[..., :half], keys[..., half:])  # [slots, Hkv, L, D/2]
            k_amax = pair_norm.transpose(0, 1).reshape(config.num_kv_heads, -1).amax(dim=1)
            v_amax = cache.values[layer].abs().transpose(0, 1).reshape(config.num_kv_heads, -1).amax(dim=1)
            out[layer] = (k_amax.cpu(), v_amax.cpu())
    memo[weights] = out
    return out
