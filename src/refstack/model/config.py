"""The model's shape: one frozen dataclass, validated on construction, with presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LM_HEAD_PRECISIONS = ("fp32", "tf32", "3xtf32", "bf16")
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """Everything needed to build the model, weights included (they come from ``seed``)."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    # Layer i is full (GQA) attention when (i + 1) % full_attn_every == 0, KDA otherwise;
    # e.g. 4 gives the 3:1 KDA:attention mix of Kimi Linear.
    full_attn_every: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    kda_num_heads: int = 4
    kda_head_k_dim: int = 32
    kda_head_v_dim: int = 32
    kda_chunk_size: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    expert_hidden_size: int = 64
    ep_ranks: int = 2
    rms_eps: float = 1e-6
    max_seq_len: int = 512
    seed: int = 0
    lm_head_precision: str = "fp32"
    # The GEMMs' operand type.  "bfloat16": the projection and expert weights are rounded
    # to bf16 (drawn in fp32 from the seed first, so both dtypes share one model) and each
    # GEMM rounds its input rows to bf16 and accumulates in fp32.  Everything else (the
    # residual stream, norms, router, KDA state, attention, KV cache, LM head) stays fp32.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_layers", "full_attn_every", "num_heads", "num_kv_heads",
            "head_dim", "kda_num_heads", "kda_head_k_dim", "kda_head_v_dim", "kda_chunk_size",
            "num_experts", "num_experts_per_tok", "expert_hidden_size", "ep_ranks", "max_seq_len",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"HybridConfig.{name}: expected a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"HybridConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"HybridConfig.head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"HybridConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        if self.num_experts % self.ep_ranks:
            raise ValueError(
                f"HybridConfig.num_experts ({self.num_experts}) must split evenly over ep_ranks ({self.ep_ranks})"
            )
        # The chunked KDA splits each chunk into sub-chunks of 16 (see kda_ops); a chunk
        # is either one sub-chunk or a whole number of them.
        if self.kda_chunk_size > 16 and self.kda_chunk_size % 16:
            raise ValueError(
                f"HybridConfig.kda_chunk_size: expected <= 16 or a multiple of 16, got {self.kda_chunk_size}"
            )
        if self.lm_head_precision not in LM_HEAD_PRECISIONS:
            raise ValueError(
                f"HybridConfig.lm_head_precision: expected one of {LM_HEAD_PRECISIONS}, got {self.lm_head_precision!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"HybridConfig.dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if not self.rms_eps > 0:
            raise ValueError(f"HybridConfig.rms_eps: expected > 0, got {self.rms_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"HybridConfig.rope_theta: expected > 0, got {self.rope_theta!r}")

    # ------------------------------------------------------------------ derived
    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attn_every == 0

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_full_attention(i))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if not self.is_full_attention(i))

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_ranks

    # ------------------------------------------------------------------ builders
    def with_overrides(self, **overrides: Any) -> HybridConfig:
        """A copy with some fields changed; validated like a fresh config."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"HybridConfig has no field(s) {unknown}; known fields: {sorted(names)}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> HybridConfig:
        """``tiny`` is for tests (fast on a CPU); ``small`` is for benchmarks."""
        try:
            base = _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown HybridConfig preset {name!r}; known: {sorted(_PRESETS)}") from None
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512, "hidden_size": 64, "num_layers": 4, "full_attn_every": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "kda_num_heads": 4, "kda_head_k_dim": 16, "kda_head_v_dim": 16, "kda_chunk_size": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "expert_hidden_size": 32, "ep_ranks": 2,
        "max_seq_len": 512,
    },
    "small": {
        "vocab_size": 512, "hidden_size": 512, "num_layers": 8, "full_attn_every": 4,
        "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
        "kda_num_heads": 4, "kda_head_k_dim": 64, "kda_head_v_dim": 64, "kda_chunk_size": 64,
        # 8 experts of 256 hold as many MLP weights as a dense 2048-wide MLP (4x hidden),
        # while each token runs only 2 of them (an active width of 512).
        "num_experts": 8, "num_experts_per_tok": 2, "expert_hidden_size": 256, "ep_ranks": 4,
        "max_seq_len": 2048,
    },
}
