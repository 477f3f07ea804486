"""Mixture-of-experts MLP with expert-parallel dispatch and combine.

The experts are split over ``ep_ranks`` ranks (contiguous groups of experts, as in
DeepEP).  ``dispatch`` sorts the routed token copies by expert and hands each rank
its experts' rows in one of two layouts:

- ``grouped`` (DeepEP normal mode): the rank's rows back to back, grouped by expert,
  with per-expert counts; the rank runs one GEMM pair per *active* expert on exactly
  its rows, so idle experts' weights are never read (what small batches need);
- ``padded`` (DeepEP low-latency mode): ``[experts_per_rank, capacity, hidden]``;
  the rank runs all its experts in one batched GEMM pair.  With one torch thread it
  measured slower than ``grouped`` (padding rows cost compute, and MKL's batched GEMM
  is less efficient), but MKL runs a small GEMM on one thread only while it splits a
  batched GEMM's experts over the threads: with 2 threads and every expert busy
  (decode at batch >= 8), streaming the experts' weights on both cores wins.

``auto`` (the default) picks ``padded`` when there are several threads and on
average at least two copies per expert, ``grouped`` otherwise; on a GPU always
``padded``, with room for every token per expert, so no step waits on a host read.

``combine`` brings the outputs back and sums them per token with the router
weights.  All ranks live in this process, but the three phases are separate
functions with their own spans, so a timeline shows them the way it would show the
communication library's intervals.

The token shuffle of dispatch and combine is an expert-parallel library's section
(span ``ep.dispatch`` / ``ep.combine``, category ``ep``, inside ``moe.dispatch`` /
``moe.combine``).  ``EPSettings`` (the ``ep_release_gil`` and ``ep_link_gbps`` knobs)
shape it as DeepEP's intranode path is shaped: the ranks' rows are copied, then the
caller waits in native code until the peers' rows have landed.  The wait is
modelled (every rank lives here, so nothing is really in flight): the bytes that
cross ranks divided by the link bandwidth, ``ep_link_gbps`` (0, the default: no
wait); it sleeps rather than spins (``refstack_ep_wait``: on a real host the polling
thread has a core of its own).  With ``ep_release_gil`` false the native section holds
the GIL while it copies and waits (a ``ctypes.PyDLL`` call), so no other Python thread
of the process runs meanwhile; true (the default) releases it (``CDLL``).  On the
native kernels the whole section is native.  On torch's path the copy is torch ops,
which release the GIL themselves, so only the modelled wait is native (run by the
kernel library when it builds; without a C compiler there is no wait and the knob
changes nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infra_agent import tracing
from refstack.kernels import cpu_blocks, cpu_kernels, cpu_moe
from refstack.model.config import HybridConfig
from refstack.model.layers import Linear, round_bf16, seeded_weight

if TYPE_CHECKING:
    from refstack.model.quant_layers import QuantizedExperts


@dataclass(frozen=True, slots=True)
class EPSettings:
    """How the expert-parallel exchange behaves (see the module docstring)."""

    release_gil: bool = True  # the native section releases the GIL (CDLL) or holds it (PyDLL)
    link_gbps: float = 0.0  # modelled link bandwidth of the ranks' exchange; 0: no wait

    @property
    def ns_per_byte(self) -> float:
        return 1.0 / self.link_gbps if self.link_gbps > 0 else 0.0


DEFAULT_EP = EPSettings()


@dataclass(slots=True)
class Dispatched:
    """Per-rank token buffers plus what combine needs to route the results back."""

    buffers: list[Tensor]  # per rank: grouped [rows, hidden] or padded [experts_per_rank, capacity, hidden]
    counts: list[int]  # routed copies per expert, global expert order (empty: padded on a GPU)
    token_ids: Tensor  # [T*k] source token of each copy, in expert order
    weights: Tensor  # [T*k] router weight of each copy, in expert order
    num_tokens: int
    # [T, k] row of each (token, choice) copy in the ranks' concatenated outputs.
    copy_slot: Tensor
    copy_weights: Tensor  # [T, k] router weight of each (token, choice) copy
    # Padded layout only: each copy's flat position (expert * capacity + row), and the
    # whole [experts, capacity, hidden] buffer the rank buffers are views of.
    padded_index: Tensor | None = None
    padded: Tensor | None = None
    # Grouped layout only: every rank's rows back to back (the buffers are views of it).
    grouped: Tensor | None = None
    native: bool = False  # built by the native kernels; combine uses them too
    cross_bytes: int = 0  # bytes that crossed ranks (and come back in combine)
    ep: EPSettings = DEFAULT_EP

    @property
    def layout(self) -> str:
        return "grouped" if self.padded_index is None else "padded"


def route(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Softmax router, top k experts, their weights renormalised to sum to 1.

    Renormalised top-k softmax probabilities equal a softmax over the top-k logits
    (the full softmax's denominator cancels), which is two ops instead of four.
    """
    logits, ids = router_logits.topk(top_k, dim=-1)
    return ids, torch.softmax(logits, dim=-1)


def _rows_per_rank(counts: list[int], per_rank: int) -> list[int]:
    """Routed copies per rank, from the copies per expert (ranks own contiguous experts)."""
    return [sum(counts[r : r + per_rank]) for r in range(0, len(counts), per_rank)]


def _cross_bytes(topk_ids: Tensor, num_experts: int, ep_ranks: int, hidden: int, ep: EPSettings) -> int:
    """Bytes crossing ranks, counted only when a link is modelled (the count is the only cost)."""
    if ep.ns_per_byte <= 0 or ep_ranks <= 1 or not cpu_kernels.available():
        return 0
    return cpu_moe.ep_cross_bytes(topk_ids, num_experts, ep_ranks, hidden)


def _ep_wait(nbytes: int, ep: EPSettings) -> None:
    """The modelled wait of torch's path (its copies are torch ops); needs the kernel library."""
    if nbytes:
        cpu_moe.ep_wait(nbytes, ep.ns_per_byte, release_gil=ep.release_gil)


def dispatch(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int, ep_ranks: int, layout: str = "grouped",
    ep: EPSettings = DEFAULT_EP,
) -> Dispatched:
    """Group token copies by expert (a stable sort) and split them by rank.

    ``layout``: "grouped", "padded" (see the module docstring) or "native" (grouped,
    built by ``cpu_moe.ep_dispatch``).  ``ep``: the exchange's GIL and link model.
    """
    with tracing.span("moe.dispatch", cat="moe", tokens=int(x.shape[0])):
        cross = _cross_bytes(topk_ids, num_experts, ep_ranks, x.shape[-1], ep)
        with tracing.span("ep.dispatch", cat="ep", tokens=int(x.shape[0]), bytes=cross,
                          gil="released" if ep.release_gil else "held"):
            d = _dispatch(x, topk_ids, topk_weights, num_experts, ep_ranks, layout, cross, ep)
        d.cross_bytes, d.ep = cross, ep
        return d


def _dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int, ep_ranks: int, layout: str,
              cross: int, ep: EPSettings) -> Dispatched:
    T, k = topk_ids.shape
    per_rank = num_experts // ep_ranks
    if layout == "native":
        # The grouped layout through one native section (a counting sort, a gather, the wait).
        rows, counts, slot, token_ids, weights = cpu_moe.ep_dispatch(
            x, topk_ids, topk_weights, num_experts, cross, ep.ns_per_byte, release_gil=ep.release_gil)
        return Dispatched(list(rows.split(_rows_per_rank(counts, per_rank))), counts, token_ids, weights, T, slot, topk_weights,
                          grouped=rows, native=True)
    _ep_wait(cross, ep)  # torch's copies release the GIL themselves; only the wait is native
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # On a GPU the padded layout never reads the counts on the host (that would stall
    # every layer on a sync, as bincount's size check does): its capacity is T, since a
    # token picks an expert at most once, and ``counts`` stays empty.
    on_device = layout == "padded" and x.is_cuda
    if on_device:
        counts_t = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    else:
        counts_t = torch.bincount(flat, minlength=num_experts)
    counts = [] if on_device else counts_t.tolist()
    token_ids = order // k
    weights = topk_weights.reshape(-1)[order]
    if layout == "grouped":
        rows = x.index_select(0, token_ids)
        # Copy i (expert order) sits at output row i; invert the sort for combine.
        slot = torch.empty_like(order).index_copy_(0, order, torch.arange(T * k, device=x.device))
        return Dispatched(list(rows.split(_rows_per_rank(counts, per_rank))), counts, token_ids, weights, T, slot.view(T, k), topk_weights,
                          grouped=rows)
    assert layout == "padded", f"unknown MoE dispatch layout {layout!r}"
    capacity = T if on_device else max(counts)
    # The sorted ids are each copy's expert; its row is its rank within the expert.
    expert_of_row = flat[order]
    starts = counts_t.cumsum(0) - counts_t
    index = expert_of_row * capacity + (torch.arange(T * k, device=x.device) - starts[expert_of_row])
    # One gather fills the buffer: empty rows read an appended zero row (index T),
    # instead of zero-filling the buffer and scattering the rows into it.
    src = torch.full((num_experts * capacity,), T, dtype=torch.long, device=x.device).index_copy_(0, index, token_ids)
    padded = torch.cat([x, x.new_zeros(1, x.shape[-1])]).index_select(0, src)
    buffers = list(padded.view(ep_ranks, per_rank, capacity, -1).unbind(0))
    slot = torch.empty_like(order).index_copy_(0, order, index)
    return Dispatched(
        buffers, counts, token_ids, weights, T, slot.view(T, k), topk_weights, index, padded.view(num_experts, capacity, -1)
    )


def combine(outputs: list[Tensor], d: Dispatched) -> Tensor:
    """Weighted sum of each token's expert outputs, back in token order."""
    with tracing.span("moe.combine", cat="moe", tokens=d.num_tokens), \
            tracing.span("ep.combine", cat="ep", tokens=d.num_tokens, bytes=d.cross_bytes,
                         gil="released" if d.ep.release_gil else "held"):
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        out = out.reshape(-1, out.shape[-1])  # grouped rows, or padded [experts * capacity]
        if d.native:
            return cpu_moe.ep_combine(out, d.copy_slot, d.copy_weights, d.cross_bytes, d.ep.ns_per_byte,
                                          release_gil=d.ep.release_gil)
        _ep_wait(d.cross_bytes, d.ep)
        # One gather puts each token's k expert outputs side by side; the sum runs over
        # the token's own top-k order, so a sequence gets the same sum alone or batched
        # (no zero-filled buffer, no scatter-add).
        T, k = d.copy_slot.shape
        picked = out.index_select(0, d.copy_slot.view(-1)).view(T, k, -1)
        return (picked * d.copy_weights.unsqueeze(-1)).sum(1)


def swiglu_experts(buf: Tensor, counts: list[int], w_gate_up: Tensor, w_down: Tensor, bf16: bool = False) -> Tensor:
    """One rank's experts over its buffer: ``down(silu(gate) * up)`` per expert.

    ``bf16``: the GEMM inputs (the rows, and silu(gate) * up) are rounded to bf16 first,
    as the bf16 kernels do (the weights are already bf16 values).

    w_gate_up [E_r, hidden, 2I]; w_down [E_r, I, hidden].  A padded buffer
    [E_r, capacity, hidden] runs as one batched GEMM pair.  A grouped buffer
    [n, hidden] (rows grouped by expert, ``counts`` per local expert) runs one GEMM
    pair per active expert on exactly its rows, so idle experts' weights are not read.
    """
    def rounded(t: Tensor) -> Tensor:
        return round_bf16(t) if bf16 else t

    if buf.dim() == 3:
        gate, up = torch.bmm(rounded(buf), w_gate_up).chunk(2, dim=-1)
        return torch.bmm(rounded(F.silu(gate).mul_(up)), w_down)
    out = torch.empty_like(buf)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate, up = (rounded(buf[start : start + n]) @ w_gate_up[e]).chunk(2, dim=-1)
            torch.mm(rounded(F.silu(gate).mul_(up)), w_down[e], out=out[start : start + n])
            start += n
    return out


class MoE(nn.Module):
    def __init__(self, config: HybridConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts, self.top_k, self.ep_ranks = config.num_experts, config.num_experts_per_tok, config.ep_ranks
        E, D, inner = config.num_experts, config.hidden_size, config.expert_hidden_size
        self.router = Linear(D, E, gen)
        self.dispatch_layout = "auto"  # "auto", "grouped" or "padded": see the module docstring
        self.ep = DEFAULT_EP  # the exchange's GIL and link model (HybridModel.configure_ep)
        # [E, in, out] so the batched matmul needs no transpose.  (Stored [E, out, in],
        # a decode step's 2-8 rows per expert would stream the weights faster with the
        # weight as the left operand, but the padded batched GEMM at 8+ rows per expert
        # then measured 15-20% slower; batch 32 decode needs the latter more.)
        self.w_gate_up = seeded_weight(gen, E, D, 2 * inner, std=1.0 / math.sqrt(D))
        self.w_down = seeded_weight(gen, E, inner, D, std=1.0 / math.sqrt(inner * 2 * config.num_layers))

        # Column-blocked copies for the native kernel (use_native); derived, never saved.
        self.packed: tuple[Tensor, Tensor] | None = None
        self.bf16 = False  # see round_to_bf16
        # W8A8 experts (refstack.model.quant): int8 gate|up and down; the router stays as it is.
        self.w8a8: QuantizedExperts | None = None

    def round_to_bf16(self) -> None:
        """bf16 experts (weights rounded in place, irreversibly; before ``use_native``).
        The router stays fp32: it is 0.1% of the FLOPs and decides where tokens go."""
        for w in (self.w_gate_up, self.w_down):
            w.copy_(round_bf16(w))
        self.bf16 = True

    def use_native(self, on: bool) -> None:
        if self.w8a8 is not None:
            self.packed = self.w8a8.pack() if on else None
            return
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.packed = (cpu_kernels.pack_gate_up(self.w_gate_up, dtype), cpu_kernels.pack_down(self.w_down, dtype)) \
            if on else None

    def rank_weights(self, rank: int) -> tuple[Tensor, Tensor]:
        per = self.num_experts // self.ep_ranks
        return self.w_gate_up[rank * per : (rank + 1) * per], self.w_down[rank * per : (rank + 1) * per]

    def layout_for(self, num_tokens: int) -> str:
        if self.dispatch_layout != "auto":
            return self.dispatch_layout
        if self.packed is not None:
            return "native"  # grouped, by the native kernels: each expert reads exactly its rows
        if self.w_down.is_cuda:
            return "padded"  # the one layout with no host read of the counts (see _dispatch)
        busy = num_tokens * self.top_k >= 2 * self.num_experts
        return "padded" if busy and torch.get_num_threads() > 1 else "grouped"

    def forward(self, x: Tensor) -> Tensor:
        # Natively, top-k and its softmax run in C, as in the native decode step.
        topk_ids, topk_weights = (cpu_blocks.moe_route if self.packed is not None else route)(self.router(x), self.top_k)
        d = dispatch(x, topk_ids, topk_weights, self.num_experts, self.ep_ranks, self.layout_for(x.shape[0]), self.ep)
        per = self.num_experts // self.ep_ranks
        with tracing.span("moe.experts", cat="moe", layer=self.layer, tokens=d.num_tokens):
            if self.packed is not None and d.grouped is not None:
                # The ranks share this process: gate/up, silu and down of all their
                # experts in one native call (one fork/join of the threads, not one per rank).
                outputs = [cpu_moe.moe_experts(d.grouped, d.counts, *self.packed)]
            elif self.w8a8 is not None:  # W8A8 on torch's path: torch._int_mm per expert
                outputs = [self.w8a8.padded(d.padded, 0)] if d.padded is not None else [
                    self.w8a8.grouped(buf, d.counts[r * per : (r + 1) * per], r * per) for r, buf in enumerate(d.buffers)]
            elif d.padded is not None:
                # The ranks share this process: one batched GEMM pair over all their
                # experts lets MKL spread the experts over the threads.
                outputs = [swiglu_experts(d.padded, d.counts, self.w_gate_up, self.w_down, self.bf16)]
            else:
                outputs = [
                    swiglu_experts(buf, d.counts[r * per : (r + 1) * per], *self.rank_weights(r), self.bf16)
                    for r, buf in enumerate(d.buffers)
                ]
        return combine(outputs, d)
