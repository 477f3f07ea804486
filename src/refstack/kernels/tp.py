"""Tensor-parallel kernels, with N ranks simulated in one process.

Each rank's work is a real slice of the weights; the collectives are explicit sums
and concatenations whose *association order* matches what a real collective does, so
the numerics of a TP deployment can be studied on one CPU (and compared against the
unpartitioned computation) without a process group.

What partitioning changes, numerically:

- **Vocab-parallel LM head** (each rank holds ``V/N`` rows of the ``[V, H]`` weight;
  logits are all-gathered).  Every logit is still one full-length dot product over H,
  so the logits are the *same computation* -- identical up to whatever the GEMM
  library does differently for a narrower N.  Only the reductions *across* the
  vocabulary (log-softmax's max and sum-of-exp, argmax) become cross-rank
  collectives.
- **Row-parallel output projection** (each rank holds ``in/N`` columns of the
  ``[out, in]`` weight and the matching slice of the input; partial products are
  all-reduced).  This is split-K: every output element becomes a sum of N partial dot
  products, so its fp32 rounding differs from the unpartitioned K-reduction.  Alone
  that is an fp32-ulp effect -- but a downstream TF32 consumer truncates its inputs
  to 10 mantissa bits, which can turn a one-ulp difference into a 2**-10 jump.
- **Column-parallel q/k/v/gate projections** split output features (whole heads per
  rank); no reduction changes.

``order`` selects the all-reduce's association order: ``"ring"`` (NCCL's ring
reduce-scatter: chunk ``c`` of the buffer is accumulated starting at rank ``c`` and
travelling round the ring) or ``"sequential"`` (``((p0 + p1) + p2) + ...``).  The ring
model reproduces the *kind* of rounding a ring gives (each element a left-to-right sum
of N partials in a rotated order), not NCCL's exact chunk boundaries, which depend on
message size and channel count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from refstack.kernels.precision import matmul

REDUCE_ORDERS: tuple[str, ...] = ("ring", "sequential")


# --- collectives ---------------------------------------------------------------------

def shard(x: torch.Tensor, world_size: int, dim: int) -> list[torch.Tensor]:
    """Split ``x`` into ``world_size`` contiguous slices along ``dim`` (rank order).

    Uneven sizes are allowed (the first ``size % N`` ranks get one more row), as when a
    vocabulary is not a multiple of the TP degree and is not padded."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if x.shape[dim] < world_size:
        raise ValueError(f"cannot shard dim {dim} of size {x.shape[dim]} over {world_size} ranks")
    return list(torch.tensor_split(x, world_size, dim=dim))


def all_gather(shards: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Concatenate in rank order: a gather moves bytes, it does no arithmetic."""
    return torch.cat(list(shards), dim=dim)


def all_reduce_sum(partials: Sequence[torch.Tensor], order: str = "ring") -> torch.Tensor:
    """Elementwise sum of the ranks' partials, associated the way ``order`` says."""
    if order not in REDUCE_ORDERS:
        raise ValueError(f"order must be one of {REDUCE_ORDERS}, got {order!r}")
    n = len(partials)
    assert n >= 1 and all(p.shape == partials[0].shape for p in partials)
    if n == 1:
        return partials[0].clone()
    if order == "sequential":
        acc = partials[0].clone()
        for p in partials[1:]:
            acc = acc + p
        return acc
    flat = [p.reshape(-1) for p in partials]
    out = torch.empty_like(flat[0])
    bounds = [c.numel() for c in torch.tensor_split(flat[0], n)]
    start = 0
    for c, size in enumerate(bounds):
        sl = slice(start, start + size)
        acc = flat[c][sl].clone()  # chunk c starts at rank c and travels the ring
        for step in range(1, n):
            acc = acc + flat[(c + step) % n][sl]
        out[sl] = acc
        start += size
    return out.reshape(partials[0].shape)


def all_reduce_max(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """Elementwise max: exact, so the order cannot matter."""
    return torch.stack(list(partials)).amax(dim=0)


# --- vocab-parallel LM head ----------------------------------------------------------

def _local_logits(h: torch.Tensor, weight: torch.Tensor, world_size: int, precision: str) -> list[torch.Tensor]:
    # weight is [V, H] (nn.Linear layout); rank r multiplies by its [V/N, H] slice.
    return [matmul(h, w_r.t(), precision) for w_r in shard(weight, world_size, dim=0)]


def vocab_parallel_logits(h: torch.Tensor, weight: torch.Tensor, world_size: int,
                          precision: str = "fp32") -> torch.Tensor:
    """``h [..., H] @ weight[V, H].T`` with the vocabulary split over ranks, all-gathered."""
    return all_gather(_local_logits(h, weight, world_size, precision), dim=-1)


def vocab_parallel_argmax(h: torch.Tensor, weight: torch.Tensor, world_size: int,
                          precision: str = "fp32") -> torch.Tensor:
    """Greedy token ids without gathering the logits: each rank sends (max, index).

    Ties resolve to the lowest global index, like ``torch.argmax``."""
    local = _local_logits(h, weight, world_size, precision)
    offsets = torch.tensor([0] + [l.shape[-1] for l in local[:-1]]).cumsum(0).tolist()
    vals = torch.stack([l.max(dim=-1).values for l in local])                # [N, ...]
    idxs = torch.stack([l.argmax(dim=-1) + off for l, off in zip(local, offsets)])
    # First rank holding the global max: argmax over ranks returns the first maximum.
    best_rank = vals.argmax(dim=0, keepdim=True)
    return idxs.gather(0, best_rank).squeeze(0)


def _log_softmax_shards(local: Sequence[torch.Tensor], order: str) -> list[torch.Tensor]:
    gmax = all_reduce_max([l.amax(dim=-1, keepdim=True) for l in local])
    gsum = all_reduce_sum([torch.exp(l - gmax).sum(dim=-1, keepdim=True) for l in local], order)
    log_z = gmax + torch.log(gsum)
    return [l - log_z for l in local]


def vocab_parallel_log_softmax(h: torch.Tensor, weight: torch.Tensor, world_size: int,
                               precision: str = "fp32", order: str = "ring") -> torch.Tensor:
    """Log-probabilities with two small collectives (max, then sum of exp) instead of
    gathering ``[T, V]`` logits before normalising."""
    return all_gather(_log_softmax_shards(_local_logits(h, weight, world_size, precision), order), dim=-1)


def vocab_parallel_head(h: torch.Tensor, weight: torch.Tensor, world_size: int, precision: str = "fp32",
                        order: str = "ring") -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, logprobs)`` from one GEMM per rank (what a serving step needs)."""
    local = _local_logits(h, weight, world_size, precision)
    return all_gather(local, dim=-1), all_gather(_log_softmax_shards(local, order), dim=-1)


# --- tensor-parallel linear layers (KDA projections) ---------------------------------

def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, world_size: int,
                           precision: str = "fp32") -> list[torch.Tensor]:
    """Each rank computes ``x @ W_r.T`` for its slice of output features.  Returned per
    rank (the next op, e.g. per-head attention, consumes the shard without a gather)."""
    return [matmul(x, w_r.t(), precision) for w_r in shard(weight, world_size, dim=0)]


def row_parallel_linear(x: torch.Tensor | Sequence[torch.Tensor], weight: torch.Tensor, world_size: int,
                        precision: str = "fp32", order: str = "ring") -> torch.Tensor:
    """``x @ weight.T`` with the input features split over ranks and an all-reduce of
    the partial products (split-K across ranks).

    ``x`` is either the full ``[..., in]`` activation (sliced here) or the per-rank
    shards a column-parallel layer produced."""
    w_shards = shard(weight, world_size, dim=1)
    x_shards = shard(x, world_size, dim=-1) if isinstance(x, torch.Tensor) else list(x)
    if len(x_shards) != world_size or any(xs.shape[-1] != ws.shape[1] for xs, ws in zip(x_shards, w_shards)):
        raise ValueError("row_parallel_linear: input shards do not match the weight's column shards")
    return all_reduce_sum([matmul(xs, ws.t(), precision) for xs, ws in zip(x_shards, w_shards)], order)


def kda_projections_tp(x: torch.Tensor, weights: Mapping[str, torch.Tensor], num_heads: int,
                       world_size: int, precision: str = "fp32") -> list[dict[str, torch.Tensor]]:
    """Column-parallel q/k/v/gate (any named ``[heads*dim, hidden]`` weights) for a KDA
    layer: rank r gets heads ``[r*H/N, (r+1)*H/N)`` of every projection, so the
    recurrence runs per rank with no communication until the output projection."""
    if num_heads % world_size:
        raise ValueError(f"num_heads={num_heads} must be divisible by world_size={world_size} (whole heads per rank)")
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    for name, w in weights.items():
        if w.shape[0] % num_heads:
            raise ValueError(f"projection {name!r}: {w.shape[0]} output features are not {num_heads} whole heads")
        for r, y in enumerate(column_parallel_linear(x, w, world_size, precision)):
            per_rank[r][name] = y
    return per_rank


def kda_output_tp(o_per_rank: Sequence[torch.Tensor], weight: torch.Tensor, world_size: int,
                  precision: str = "fp32", order: str = "ring") -> torch.Tensor:
    """Row-parallel output projection of a KDA layer: each rank multiplies its heads'
    outputs by its column slice of ``W_o`` and the partial sums are all-reduced."""
    return row_parallel_linear(list(o_per_rank), weight, world_size, precision, order)
