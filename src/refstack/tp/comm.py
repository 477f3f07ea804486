"""The collectives a tensor-parallel rank makes, each one a span of its own.

``DistComm`` runs them over ``torch.distributed``: gloo on the CPU; on CUDA, NCCL when
every rank has a GPU of its own.  NCCL refuses two ranks on one device, so ranks that
share a GPU (``tp`` larger than the visible GPUs) reduce through gloo, staging each
buffer through host memory: slower, and said so in the startup line, but the same
arithmetic (a sum of the same partials).  Step messages (token ids, positions, slots)
always travel over a gloo group on host tensors, as vLLM keeps its metadata off NCCL.

``LocalComm`` is the world of one rank (``--tp 1`` with a TP-GEMM precision set): every
collective is the identity, so the sharded model runs unchanged in-process.
"""

from __future__ import annotations

import datetime
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from infra_agent import tracing

# A collective that waits longer than this is a hung peer, not a slow one: raise instead
# of blocking the engine forever (a dead peer is noticed at once by the watchdog).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


class Comm(Protocol):
    rank: int
    world: int
    backend: str

    def all_reduce(self, x: Tensor, what: str) -> Tensor: ...
    def gather_last_dim(self, x: Tensor, what: str) -> Tensor: ...
    def broadcast_host(self, x: Tensor) -> None: ...
    def close(self) -> None: ...


class LocalComm:
    """One rank: nothing to exchange."""

    rank, world, backend = 0, 1, "none"

    def all_reduce(self, x: Tensor, what: str) -> Tensor:
        return x

    def gather_last_dim(self, x: Tensor, what: str) -> Tensor:
        return x

    def broadcast_host(self, x: Tensor) -> None:
        pass

    def close(self) -> None:
        pass


def data_backend(device: str, world: int) -> str:
    """``nccl`` when every rank gets a GPU of its own, else ``gloo`` (see the module docstring)."""
    if device != "cuda":
        return "gloo"
    return "nccl" if world <= torch.cuda.device_count() else "gloo"


class DistComm:
    """One rank of a ``torch.distributed`` group; ``init_method`` is a ``file://`` rendezvous
    (no port to pick or collide on)."""

    def __init__(self, rank: int, world: int, init_method: str, device: str) -> None:
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.backend = data_backend(device, world)
        if self.device.type == "cuda":
            # Ranks with a GPU each take their own; ranks sharing one all take device 0.
            torch.cuda.set_device(rank if self.backend == "nccl" else 0)
            self.device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        # Host-side control messages never go through NCCL.
        self.control = dist.new_group(backend="gloo") if self.backend == "nccl" else dist.group.WORLD
        self._staged = self.device.type == "cuda" and self.backend == "gloo"

    def all_reduce(self, x: Tensor, what: str) -> Tensor:
        """The elementwise sum over ranks of ``x`` (a row-parallel layer's partial products)."""
        with tracing.span("tp.all_reduce", cat="tp", what=what, rank=self.rank, bytes=x.numel() * x.element_size()):
            buf = x.cpu() if self._staged else x.contiguous()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            return buf.to(self.device) if self._staged else buf

    def gather_last_dim(self, x: Tensor, what: str) -> Tensor:
        """Every rank's ``x`` concatenated along the last dimension in rank order (equal
        shards: the vocabulary splits evenly, checked at startup)."""
        with tracing.span("tp.gather", cat="tp", what=what, rank=self.rank,
                          bytes=x.numel() * x.element_size() * self.world):
            local = (x.cpu() if self._staged else x).contiguous()
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(parts, local)
            out = torch.cat(parts, dim=-1)
            return out.to(self.device) if self._staged else out

    def broadcast_host(self, x: Tensor) -> None:
        """Rank 0's host tensor ``x`` into every rank's ``x`` (same shape and dtype)."""
        dist.broadcast(x, src=0, group=self.control)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
