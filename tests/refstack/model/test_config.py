from __future__ import annotations

import dataclasses

import pytest

from refstack.model import HybridConfig


def test_presets_and_layer_mix() -> None:
    tiny = HybridConfig.preset("tiny")
    assert tiny.kda_layers and tiny.full_attention_layers
    assert set(tiny.kda_layers) | set(tiny.full_attention_layers) == set(range(tiny.num_layers))
    small = HybridConfig.preset("small")
    assert small.full_attention_layers == (3, 7)  # a 3:1 KDA:attention mix
    with pytest.raises(ValueError, match="unknown HybridConfig preset"):
        HybridConfig.preset("huge")


def test_frozen_and_overrides_are_validated() -> None:
    cfg = HybridConfig.preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3  # type: ignore[misc]
    assert cfg.with_overrides(seed=7).seed == 7 and cfg.seed == 0
    with pytest.raises(ValueError, match="num_kv_heads"):
        cfg.with_overrides(num_kv_heads=3)
    with pytest.raises(ValueError, match="ep_ranks"):
        cfg.with_overrides(ep_ranks=3)
    with pytest.raises(ValueError, match="lm_head_precision"):
        cfg.with_overrides(lm_head_precision="fp8")
    with pytest.raises(ValueError, match="no field"):
        cfg.with_overrides(hidden=3)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        cfg.with_overrides(num_experts_per_tok=99)
    with pytest.raises(ValueError, match="kda_chunk_size"):
        cfg.with_overrides(kda_chunk_size=24)
