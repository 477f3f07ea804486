"""Storage types of the KV cache and the KDA state: the knobs parsed, and what they cost.

Arithmetic on the model's shape, no tensors: ``refstack.engine.device`` validates the
knobs with these before anything is built.

- ``kv_cache_dtype`` sets every attention layer's KV storage ("auto" is fp32, the cache
  as it always was); ``kv_cache_dtype_layers`` ("LAYER:DTYPE,...") overrides single
  layers, LAYER being the model's layer index of an attention layer (the index the cache,
  the trace spans and ``HybridConfig.full_attention_layers`` use).
- ``kda_state_dtype`` is the KDA recurrent state's storage, fp32 or bf16.

``resolve_kv_dtypes`` gives each attention layer a concrete type ("fp32", "bf16",
"fp8_e4m3", "int8"); ``footprint`` the bytes per token and per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refstack.model.config import HybridConfig

# The storage types, as the knob spells them ("auto" is not one: it resolves to fp32).
KV_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp8_e4m3", "int8")
KV_DTYPE_CHOICES: tuple[str, ...] = ("auto", *KV_DTYPES)
STATE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
ELEMENT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp8_e4m3": 1, "int8": 1}
# The types stored with a scale per (layer, KV head) (see refstack.model.cache.KVCodec).
SCALED: frozenset[str] = frozenset({"fp8_e4m3", "int8"})
FLAG = "--kv-cache-dtype-layers"
GIB = 1 << 30  # the memory budget /debug/engine and the startup line count sequences for


def parse_kv_cache_dtype_layers(spec: str, config: HybridConfig, model: str = "the model") -> dict[int, str]:
    """``"LAYER:DTYPE,..."`` as {layer: dtype} ("auto" kept as written); ``ValueError``
    with one line naming the knob, the bad entry and what was expected (``model`` names
    the model in it, e.g. "preset tiny")."""
    attn = ", ".join(map(str, config.full_attention_layers)) or "none"
    layers_words = f"{model} has layers 0..{config.num_layers - 1}; its attention layers are {attn}"
    out: dict[int, str] = {}
    if not spec.strip():
        return out
    for raw in spec.split(","):
        entry = raw.strip()
        layer_text, sep, dtype = (part.strip() for part in entry.partition(":"))
        if not sep or not layer_text or not dtype:
            raise ValueError(f"{FLAG} {spec!r}: entry {entry!r} is not LAYER:DTYPE (e.g. '1:bf16,3:int8')")
        try:
            layer = int(layer_text)
        except ValueError:
            raise ValueError(f"{FLAG} {spec!r}: entry {entry!r}: layer {layer_text!r} is not an integer "
                             f"({layers_words})") from None
        if dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"{FLAG} {spec!r}: entry {entry!r}: unknown dtype {dtype!r} "
                             f"(expected one of {', '.join(KV_DTYPE_CHOICES)})")
        if not 0 <= layer < config.num_layers:
            raise ValueError(f"{FLAG} {spec!r}: entry {entry!r}: unknown layer index {layer} ({layers_words})")
        if not config.is_full_attention(layer):
            raise ValueError(f"{FLAG} {spec!r}: entry {entry!r}: layer {layer} is a KDA layer, not an attention "
                             f"layer ({layers_words})")
        if layer in out:
            raise ValueError(f"{FLAG} {spec!r}: entry {entry!r}: layer {layer} is given twice")
        out[layer] = dtype
    return out


def resolve_kv_dtypes(kv_cache_dtype: str, kv_cache_dtype_layers: str, config: HybridConfig) -> dict[int, str]:
    """Every attention layer's storage type: the override, else the default; "auto" is fp32."""
    if kv_cache_dtype not in KV_DTYPE_CHOICES:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_DTYPE_CHOICES)}")
    overrides = parse_kv_cache_dtype_layers(kv_cache_dtype_layers, config)
    chosen = {layer: overrides.get(layer, kv_cache_dtype) for layer in config.full_attention_layers}
    return {layer: "fp32" if d == "auto" else d for layer, d in chosen.items()}


def check_state_dtype(state_dtype: str) -> str:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"--kda-state-dtype {state_dtype!r}: expected one of {', '.join(STATE_DTYPES)}")
    return state_dtype


def footprint(config: HybridConfig, kv_dtypes: Mapping[int, str], state_dtype: str, max_seq_len: int) -> dict[str, Any]:
    """What a sequence costs in the cache: attention KV bytes per token (K and V of every KV
    head, summed over the attention layers; the per-(layer, head) scales are not counted:
    a few floats per layer), KDA state bytes per sequence (every KDA layer), and the
    sequences of ``max_seq_len`` tokens that fit in 1 GiB."""
    per_head_token = 2 * config.num_kv_heads * config.head_dim  # K and V elements of one layer
    kv = sum(per_head_token * ELEMENT_BYTES[kv_dtypes.get(layer, "fp32")] for layer in config.full_attention_layers)
    kv_fp32 = per_head_token * 4 * len(config.full_attention_layers)
    state_elems = config.kda_num_heads * config.kda_head_k_dim * config.kda_head_v_dim
    state = state_elems * ELEMENT_BYTES[state_dtype] * len(config.kda_layers)
    per_seq = kv * max_seq_len + state
    return {
        "kv_dtypes": {str(layer): kv_dtypes.get(layer, "fp32") for layer in config.full_attention_layers},
        "kda_state_dtype": state_dtype,
        "kv_bytes_per_token": kv,
        "kv_bytes_per_token_fp32": kv_fp32,
        "kda_state_bytes_per_sequence": state,
        "max_seq_len": max_seq_len,
        "bytes_per_sequence": per_seq,  # a sequence of max_seq_len tokens: its KV rows and its KDA states
        "sequences_per_gib": GIB // per_seq if per_seq else 0,
        "scales": "per (attention layer, KV head), fixed at cache creation from a calibration pass",
    }


def describe(fp: Mapping[str, Any]) -> str:
    """The footprint as one line (the server's startup line)."""
    kinds = sorted(set(fp["kv_dtypes"].values()))
    if len(kinds) == 1:
        kv = kinds[0]
    else:
        kv = "mixed " + ",".join(f"{layer}:{d}" for layer, d in fp["kv_dtypes"].items())
    return (f"KV cache {kv} {fp['kv_bytes_per_token']} B/token (fp32: {fp['kv_bytes_per_token_fp32']}), "
            f"KDA state {fp['kda_state_dtype']} {fp['kda_state_bytes_per_sequence']} B/sequence, "
            f"{fp['bytes_per_sequence']} B per {fp['max_seq_len']}-token sequence, "
            f"{fp['sequences_per_gib']} sequences per GiB")
