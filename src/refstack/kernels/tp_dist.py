"""The same tensor-parallel kernels as ``tp``, over a real ``torch.distributed`` group.

Each process is one rank and holds only its shard; the collectives are the library's
(gloo on the CPU, NCCL on GPUs).  ``tp`` simulates these in one process with an
explicit reduction order; the tests check the two agree (bitwise for 2 ranks, where
a sum of two partials has only one rounding, and at fp32 level beyond).

Sharding helpers return *this rank's* slice, using the same boundaries as
``tp.shard`` (``torch.tensor_split``), so a weight sharded here lines up with the
simulation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from refstack.kernels.precision import matmul
from refstack.kernels.tp import shard


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def local_shard(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's slice of a full tensor (for tests and for loading full checkpoints)."""
    rank, world = _group_info(group)
    return shard(x, world, dim)[rank].contiguous()


def row_parallel_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, precision: str = "fp32",
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x @ W.T`` where this rank holds ``x[..., in_r]`` and ``W[:, in_r]``; the partial
    products are summed by the library's all-reduce (its own association order)."""
    partial = matmul(x_shard, w_shard.t(), precision).contiguous()
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial


def vocab_parallel_logits(h: torch.Tensor, w_shard: torch.Tensor, vocab_size: int, precision: str = "fp32",
                          group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Full ``[..., V]`` logits on every rank from this rank's ``[V_r, H]`` weight slice.

    Slices may be uneven (``tensor_split`` boundaries), so the gather goes through
    ``all_gather`` of per-rank sizes padded to the largest slice."""
    rank, world = _group_info(group)
    local = matmul(h, w_shard.t(), precision).contiguous()
    sizes = [t.shape[0] for t in torch.tensor_split(torch.empty(vocab_size), world)]
    assert local.shape[-1] == sizes[rank], (local.shape, sizes)
    width = max(sizes)
    pad = torch.zeros(*local.shape[:-1], width, dtype=local.dtype, device=local.device)
    pad[..., : local.shape[-1]] = local
    gathered = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(gathered, pad, group=group)
    return torch.cat([g[..., :n] for g, n in zip(gathered, sizes)], dim=-1)
