"""Cut a ``HybridModel`` down to one tensor-parallel rank's shard, in place.

Every rank builds the whole seeded model (the same weights, from ``config.seed``) and
keeps its slice, so no checkpoint is sent anywhere.  What each rank holds:

- KDA: heads ``[r*H/N, (r+1)*H/N)``.  The fused input projection keeps those heads'
  rows of q, k, v and beta, plus the low-rank bottleneck rows (shared by every head,
  so replicated: ``2 * V`` outputs); the low-rank up-projection, ``dt_bias`` and
  ``A_log`` keep those heads' rows (column-parallel).  The recurrence and its state are
  local per head.  ``o_proj`` keeps those heads' input columns (row-parallel) and its
  partial products are all-reduced.
- GQA: query heads ``[r*Hq/N, ...)`` and KV heads ``[r*Hkv/N, ...)`` (a query head's KV
  head is on the same rank since ``Hq/Hkv`` query heads share one); ``o_proj``
  row-parallel with an all-reduce; the KV cache holds only the local KV heads.
- MoE: the experts split over ranks in contiguous groups (the expert-parallel layout);
  the router is replicated, each rank runs its experts on the copies routed to them,
  and the weighted sums are all-reduced.  With top-2 each partial has one nonzero term,
  so the reduction is the single rank's sum of two.
- LM head: the vocabulary's ``[r*V/N, (r+1)*V/N)`` columns (vocab-parallel); local logits,
  then an all-gather: the sampler needs full rows anyway (top-p, logprobs, masking).
- Embedding, norms, residual stream: replicated (every rank holds the same stream after
  each all-reduce).

The projection GEMMs run at ``gemm_precision`` (``refstack.kernels.precision``); "fp32"
is the single-rank model's own matmul.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from infra_agent import tracing
from refstack.kernels.precision import matmul as precision_matmul
from refstack.model.attention import AttentionLayer
from refstack.model.config import HybridConfig
from refstack.model.kda import KDALayer
from refstack.model.layers import matmul_rows, round_bf16
from refstack.model.model import DecoderLayer, HybridModel
from refstack.model.moe import MoE, route, swiglu_experts
from refstack.tp.comm import Comm


def local_config(config: HybridConfig, world: int) -> HybridConfig:
    """The shapes one rank's cache holds: its share of the KDA, query and KV heads."""
    return config.with_overrides(kda_num_heads=config.kda_num_heads // world, num_heads=config.num_heads // world,
                                 num_kv_heads=config.num_kv_heads // world)


def _ranges(*parts: tuple[int, int]) -> Tensor:
    return torch.cat([torch.arange(lo, hi) for lo, hi in parts])


class TPLinear(nn.Module):
    """One rank's slice of a projection, at a chosen precision; ``reduce_as`` names a
    row-parallel one, whose partial products are all-reduced."""

    def __init__(self, weight: Tensor, bf16: bool, precision: str, comm: Comm, reduce_as: str = "") -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)  # [out, in], as Linear
        self.bf16, self.precision, self.comm, self.reduce_as = bf16, precision, comm, reduce_as

    def forward(self, x: Tensor) -> Tensor:
        if self.precision == "fp32":  # exactly Linear's torch path
            y = matmul_rows(round_bf16(x) if self.bf16 else x, self.weight.t())
        else:
            y = precision_matmul(x, self.weight.t(), self.precision)
        return self.comm.all_reduce(y, self.reduce_as) if self.reduce_as else y


def shard_kda(layer: KDALayer, comm: Comm, precision: str) -> None:
    H, K, V, R = layer.num_heads, layer.k_dim, layer.v_dim, layer.rank
    n = H // comm.world
    h0, h1 = comm.rank * n, (comm.rank + 1) * n
    HK, HV = H * K, H * V
    rows = _ranges((h0 * K, h1 * K), (HK + h0 * K, HK + h1 * K), (2 * HK + h0 * V, 2 * HK + h1 * V),
                   (2 * HK + HV + h0, 2 * HK + HV + h1), (2 * HK + HV + H, 2 * HK + HV + H + 2 * R))
    layer.in_proj = TPLinear(layer.in_proj.weight[rows], layer.in_proj.bf16, precision, comm)  # type: ignore[assignment]
    up_rows = _ranges((h0 * K, h1 * K), (HK + h0 * V, HK + h1 * V))
    layer.low_rank_up = nn.Parameter(layer.low_rank_up[up_rows].contiguous(), requires_grad=False)
    layer.low_rank_bias = nn.Parameter(layer.low_rank_bias[up_rows].contiguous(), requires_grad=False)
    layer.A_log = nn.Parameter(layer.A_log[h0:h1].contiguous(), requires_grad=False)
    layer.num_heads = n
    layer.split_sizes = [2 * n * K, n * V, n, 2 * R]
    layer.o_proj = TPLinear(layer.o_proj.weight[:, h0 * V : h1 * V], layer.o_proj.bf16, precision,  # type: ignore[assignment]
                            comm, reduce_as=f"kda{layer.layer}.o_proj")


def shard_attention(layer: AttentionLayer, comm: Comm, precision: str) -> None:
    Hq, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    nq, nkv = Hq // comm.world, Hkv // comm.world
    q0, kv0 = comm.rank * nq, comm.rank * nkv
    rows = _ranges((q0 * D, (q0 + nq) * D), (Hq * D + kv0 * D, Hq * D + (kv0 + nkv) * D),
                   ((Hq + Hkv) * D + kv0 * D, (Hq + Hkv) * D + (kv0 + nkv) * D))
    layer.qkv_proj = TPLinear(layer.qkv_proj.weight[rows], layer.qkv_proj.bf16, precision, comm)  # type: ignore[assignment]
    layer.o_proj = TPLinear(layer.o_proj.weight[:, q0 * D : (q0 + nq) * D], layer.o_proj.bf16, precision,  # type: ignore[assignment]
                            comm, reduce_as=f"attn{layer.layer}.o_proj")
    layer.num_heads, layer.num_kv_heads = nq, nkv
    layer.split_sizes = [nq * D, nkv * D, nkv * D]


class TPMoE(nn.Module):
    """This rank's experts (a contiguous group) over the copies routed to them; the
    weighted sums are all-reduced (see the module docstring)."""

    def __init__(self, moe: MoE, comm: Comm) -> None:
        super().__init__()
        per = moe.num_experts // comm.world
        self.lo, self.hi = comm.rank * per, (comm.rank + 1) * per
        self.layer, self.top_k, self.bf16, self.comm = moe.layer, moe.top_k, moe.bf16, comm
        self.router = moe.router
        self.w_gate_up = nn.Parameter(moe.w_gate_up[self.lo : self.hi].contiguous(), requires_grad=False)
        self.w_down = nn.Parameter(moe.w_down[self.lo : self.hi].contiguous(), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        T, k = x.shape[0], self.top_k
        topk_ids, topk_weights = route(self.router(x), k)
        with tracing.span("moe.experts", cat="moe", layer=self.layer, tokens=T, rank=self.comm.rank):
            ids = topk_ids.reshape(-1)
            copies = ((ids >= self.lo) & (ids < self.hi)).nonzero().squeeze(1)
            mine = ids.index_select(0, copies)
            order = torch.argsort(mine, stable=True)  # rows grouped by expert, as the dispatch does
            copies, mine = copies.index_select(0, order), mine.index_select(0, order)
            counts = torch.bincount(mine - self.lo, minlength=self.hi - self.lo).tolist()
            out = swiglu_experts(x.index_select(0, copies // k), counts, self.w_gate_up, self.w_down, self.bf16)
            per_copy = x.new_zeros(T * k, x.shape[1]).index_copy_(0, copies, out)
            # The combine's own sum, over each token's top-k order; remote experts add zeros.
            partial = (per_copy.view(T, k, -1) * topk_weights.unsqueeze(-1)).sum(1)
        return self.comm.all_reduce(partial, f"moe{self.layer}")


class VocabParallelLMHead(nn.Module):
    """This rank's vocabulary columns of the LM head at ``precision``; logits all-gathered."""

    def __init__(self, weight_t: Tensor, precision: str, comm: Comm) -> None:
        super().__init__()
        cols = weight_t.shape[1] // comm.world
        self.weight_t = nn.Parameter(weight_t[:, comm.rank * cols : (comm.rank + 1) * cols].contiguous(),
                                     requires_grad=False)
        self.precision, self.comm = precision, comm

    def forward(self, h: Tensor) -> Tensor:
        with tracing.span("lm_head", cat="lm_head", tokens=int(h.shape[0]), precision=self.precision,
                          rank=self.comm.rank):
            local = precision_matmul(h, self.weight_t, precision=self.precision)
        return self.comm.gather_last_dim(local, "lm_head")


def shard_model(model: HybridModel, comm: Comm, gemm_precision: str) -> HybridModel:
    """``model`` (the whole seeded model, torch's path) cut to ``comm.rank``'s shard."""
    assert not model.native_kernels, "the shards run torch's path"
    for block in model.layers:
        assert isinstance(block, DecoderLayer)
        if isinstance(block.mixer, KDALayer):
            shard_kda(block.mixer, comm, gemm_precision)
        else:
            shard_attention(block.mixer, comm, gemm_precision)
        block.moe = TPMoE(block.moe, comm)  # type: ignore[assignment]
    model.lm_head = VocabParallelLMHead(model.lm_head.weight_t, model.lm_head.precision, comm)  # type: ignore[assignment]
    return model
