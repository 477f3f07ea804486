"""The pieces of ``refstack.tp`` without processes: the step message, and one rank's shard
(a world of one) against the unsharded model."""

from __future__ import annotations

import pytest
import torch

from refstack.engine.config import EngineConfig
from refstack.model.batch import SeqChunk
from refstack.model.config import HybridConfig
from refstack.model.model import HybridModel
from refstack.tp.comm import LocalComm
from refstack.tp.rank import RankShard
from refstack.tp.shard import local_config, shard_model
from refstack.tp.step import OP_FORWARD, decode, encode

CHUNKS = [SeqChunk(slot=3, token_ids=[7], start_pos=12), SeqChunk(slot=0, token_ids=[1, 2, 3, 4], start_pos=0),
          SeqChunk(slot=5, token_ids=[9, 8], start_pos=4)]


def test_a_step_survives_its_encoding() -> None:
    header, payload = encode(CHUNKS, {2, 1})
    msg = decode(header, payload)
    assert msg.op == OP_FORWARD and msg.every == (1, 2)
    assert [(c.slot, list(c.token_ids), c.start_pos) for c in msg.chunks] == \
        [(c.slot, list(c.token_ids), c.start_pos) for c in CHUNKS]
    assert decode(*encode(CHUNKS, ())).every == ()


def _logits(model: HybridModel | RankShard, config: HybridConfig) -> torch.Tensor:
    if isinstance(model, RankShard):
        cache = model.new_cache(8)
        first, _ = model.forward(CHUNKS[1:], cache, ())
        second, _ = model.forward([SeqChunk(slot=0, token_ids=[5], start_pos=4)], cache, ())
    else:
        cache = model.new_cache(8)
        first = model.forward_chunks(CHUNKS[1:], cache)
        second = model.forward_chunks([SeqChunk(slot=0, token_ids=[5], start_pos=4)], cache)
    return torch.cat([first, second])


def test_a_world_of_one_is_the_unsharded_model() -> None:
    torch.manual_seed(0)
    config = HybridConfig.preset("tiny")
    reference = _logits(HybridModel(config), config)
    shard = RankShard(EngineConfig(tp=1, dtype="float32", cpu_kernels="torch"), LocalComm())
    assert shard.config == config
    torch.testing.assert_close(_logits(shard, config), reference, rtol=1e-5, atol=3e-5)  # the fp32 contract


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_the_tp_gemm_precision_reaches_the_projections(precision: str) -> None:
    config = HybridConfig.preset("tiny")
    reference = _logits(HybridModel(config), config)
    shard = RankShard(EngineConfig(tp=1, dtype="float32", cpu_kernels="torch", tp_gemm_precision=precision),
                      LocalComm())
    err = (_logits(shard, config) - reference).abs().max().item()
    assert 1e-5 < err < 0.5, err  # moved by the mode's rounding, not broken


class _Rank1Of2(LocalComm):
    """Rank 1 of 2 for slicing only (no collective is run)."""

    rank, world = 1, 2


def test_a_rank_holds_its_share_of_every_head() -> None:
    config = HybridConfig.preset("small")
    local = local_config(config, 2)
    assert (local.kda_num_heads, local.num_heads, local.num_kv_heads) == (2, 4, 1)
    tiny = HybridConfig.preset("tiny")
    full, shard = HybridModel(tiny), shard_model(HybridModel(tiny), _Rank1Of2(), "fp32")
    kda, kda_full = shard.layers[0].mixer, full.layers[0].mixer
    H, K, V = 4, 16, 16  # tiny's KDA: rank 1 holds heads 2 and 3
    w, w_full = kda.in_proj.weight, kda_full.in_proj.weight
    assert torch.equal(w[: 2 * K], w_full[2 * K : 4 * K])  # q of heads 2, 3
    assert torch.equal(w[2 * K : 4 * K], w_full[H * K + 2 * K : 2 * H * K])  # k of heads 2, 3
    assert torch.equal(w[-2 * V :], w_full[-2 * V :])  # the low-rank bottleneck: every rank's
    assert torch.equal(kda.A_log, kda_full.A_log[2:])
    assert torch.equal(kda.o_proj.weight, kda_full.o_proj.weight[:, 2 * V :])
    attn, attn_full = shard.layers[1].mixer, full.layers[1].mixer
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    D = 16
    assert torch.equal(attn.qkv_proj.weight[2 * D : 3 * D], attn_full.qkv_proj.weight[5 * D : 6 * D])  # KV head 1's k
    moe, moe_full = shard.layers[0].moe, full.layers[0].moe
    assert (moe.lo, moe.hi) == (4, 8) and torch.equal(moe.w_down, moe_full.w_down[4:])
    assert torch.equal(shard.lm_head.weight_t, full.lm_head.weight_t[:, 256:])
