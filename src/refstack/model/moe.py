"""Mixture-of-experts MLP with expert-parallel dispatch and combine.

The experts are split over ``ep_ranks`` ranks (contiguous groups of experts, as in
DeepEP).  ``dispatch`` sorts the routed token copies by expert and hands each rank
the contiguous run of rows for its experts (DeepEP's normal-mode layout: no padding,
per-expert counts alongside); each rank runs only its own experts, one GEMM per
active expert on exactly its rows; ``combine`` brings the outputs back and sums them
per token with the router weights.  All ranks live in this process, but the three
phases are separate functions with their own spans, so a timeline shows them the
way it would show the communication library's intervals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infra_agent import tracing
from refstack.model.config import HybridConfig
from refstack.model.layers import Linear, seeded_weight


@dataclass(slots=True)
class Dispatched:
    """Per-rank token buffers plus what combine needs to route the results back."""

    buffers: list[Tensor]  # per rank: [tokens routed to the rank, hidden], grouped by expert
    counts: list[int]  # routed copies per expert, global expert order
    token_ids: Tensor  # [T*k] source token of each copy, in buffer order
    weights: Tensor  # [T*k] router weight of each copy, in buffer order
    num_tokens: int


def route(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Softmax over experts, keep the top k, renormalise their weights to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


def dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int, ep_ranks: int) -> Dispatched:
    """Group token copies by expert (a stable sort) and split the rows by rank."""
    with tracing.span("moe.dispatch", cat="moe", tokens=int(x.shape[0])):
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        token_ids = order // k
        rows = x.index_select(0, token_ids)
        per_rank = num_experts // ep_ranks
        rank_rows = [sum(counts[r * per_rank : (r + 1) * per_rank]) for r in range(ep_ranks)]
        return Dispatched(
            buffers=list(rows.split(rank_rows)),
            counts=counts,
            token_ids=token_ids,
            weights=topk_weights.reshape(-1)[order],
            num_tokens=T,
        )


def combine(outputs: list[Tensor], d: Dispatched) -> Tensor:
    """Weighted sum of each token's expert outputs, back in token order."""
    with tracing.span("moe.combine", cat="moe", tokens=d.num_tokens):
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T*k, hidden]
        y = out.new_zeros(d.num_tokens, out.shape[-1])
        # Rows are sorted by expert, so each token's terms are added in expert order
        # whatever else is in the batch: a sequence gets the same sum alone or batched.
        return y.index_add_(0, d.token_ids, out * d.weights.unsqueeze(-1))


def swiglu_experts(buf: Tensor, counts: list[int], w_gate_up: Tensor, w_down: Tensor) -> Tensor:
    """One rank's experts over its rows: ``down(silu(gate) * up)`` per expert.

    buf [n, hidden], rows grouped by expert with ``counts`` per local expert;
    w_gate_up [E_r, hidden, 2I]; w_down [E_r, I, hidden].  One GEMM pair per active
    expert on exactly its rows: a padded batched matmul would waste compute on the
    most loaded expert's capacity, and idle experts' weights are never read.
    """
    out = torch.empty_like(buf)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = (buf[start : start + n] @ w_gate_up[e]).chunk(2, dim=-1)
            torch.mm(F.silu(gate) * up, w_down[e], out=out[start : start + n])
            start += n
    return out


class MoE(nn.Module):
    def __init__(self, config: HybridConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts, self.top_k, self.ep_ranks = config.num_experts, config.num_experts_per_tok, config.ep_ranks
        E, D, inner = config.num_experts, config.hidden_size, config.expert_hidden_size
        self.router = Linear(D, E, gen)
        # [E, in, out] so a rank's batched matmul needs no transpose.
        self.w_gate_up = seeded_weight(gen, E, D, 2 * inner, std=1.0 / math.sqrt(D))
        self.w_down = seeded_weight(gen, E, inner, D, std=1.0 / math.sqrt(inner * 2 * config.num_layers))

    def rank_weights(self, rank: int) -> tuple[Tensor, Tensor]:
        per = self.num_experts // self.ep_ranks
        return self.w_gate_up[rank * per : (rank + 1) * per], self.w_down[rank * per : (rank + 1) * per]

    def forward(self, x: Tensor) -> Tensor:
        topk_ids, topk_weights = route(self.router(x), self.top_k)
        d = dispatch(x, topk_ids, topk_weights, self.num_experts, self.ep_ranks)
        per = self.num_experts // self.ep_ranks
        with tracing.span("moe.experts", cat="moe", layer=self.layer, tokens=d.num_tokens):
            outputs = [
                swiglu_experts(buf, d.counts[r * per : (r + 1) * per], *self.rank_weights(r))
                for r, buf in enumerate(d.buffers)
            ]
        return combine(outputs, d)
