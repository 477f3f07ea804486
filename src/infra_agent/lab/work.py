"""Work accounting for tiled kernels: how much work is repeated across tiles.

A tiled kernel (or an instrumented Python model of its tiling) reports every piece of
work it does into a ``WorkCounter``::

    counter.add("l2norm_qk", flops=6 * K, key=(seq, head))

``key`` names what the result depends on.  Two calls with the same op and key compute
the same value, so ``repeated = total - unique-by-key``: that is the work a kernel
could save by computing it once (in a prologue, or with a tile that covers the key).
The counts are measured from what the kernel did, not declared: a GPU kernel can
write per-key counters with atomics and hand them to ``add_counts``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class OpWork:
    op: str
    calls: int
    unique_keys: int
    total_flops: float
    unique_flops: float

    @property
    def repeated_flops(self) -> float:
        return self.total_flops - self.unique_flops

    @property
    def repeat_factor(self) -> float:
        """Mean number of times each distinct value was computed."""
        return self.calls / self.unique_keys if self.unique_keys else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "calls": self.calls,
            "unique_keys": self.unique_keys,
            "repeat_factor": self.repeat_factor,
            "total_flops": self.total_flops,
            "unique_flops": self.unique_flops,
            "repeated_flops": self.repeated_flops,
        }


@dataclass
class WorkCounter:
    # op -> key -> [calls, flops of the first call, total flops]
    _ops: dict[str, dict[Hashable, list[float]]] = field(default_factory=dict)

    def add(self, op: str, flops: float, key: Hashable = None, calls: int = 1) -> None:
        """Record ``calls`` computations of ``op`` costing ``flops`` each, for ``key``."""
        assert calls >= 1 and flops >= 0, f"bad work record {op}: calls={calls} flops={flops}"
        entry = self._ops.setdefault(op, {}).setdefault(key, [0.0, float(flops), 0.0])
        entry[0] += calls
        entry[2] += calls * float(flops)

    def add_counts(self, op: str, counts: torch.Tensor, flops_per_call: float) -> None:
        """Per-key call counts written by a kernel (one element per key; index = key)."""
        flat = counts.detach().to("cpu", torch.int64).reshape(-1)
        for index in torch.nonzero(flat).reshape(-1).tolist():
            key = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), counts.shape))
            self.add(op, flops_per_call, key=key, calls=int(flat[index]))

    def ops(self) -> list[OpWork]:
        out = []
        for op, keys in self._ops.items():
            calls = int(sum(e[0] for e in keys.values()))
            total = sum(e[2] for e in keys.values())
            # A repeated computation of the same key costs what its first one did.
            unique = sum(e[1] for e in keys.values())
            out.append(OpWork(op, calls, len(keys), total, unique))
        return sorted(out, key=lambda w: -w.repeated_flops)

    @property
    def total_flops(self) -> float:
        return sum(w.total_flops for w in self.ops())

    @property
    def repeated_flops(self) -> float:
        return sum(w.repeated_flops for w in self.ops())

    def repeated(self, min_factor: float = 1.0) -> list[OpWork]:
        """Ops computed more than once per key on average."""
        return [w for w in self.ops() if w.repeat_factor > min_factor and w.repeated_flops > 0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_flops": self.total_flops,
            "repeated_flops": self.repeated_flops,
            "ops": [w.to_dict() for w in self.ops()],
        }


def describe_repeat(w: OpWork, total_flops: float) -> str:
    share = w.repeated_flops / total_flops if total_flops else 0.0
    return (
        f"{w.op} is computed {w.repeat_factor:.3g}x per key ({w.calls} calls for {w.unique_keys} distinct keys); "
        f"computing it once would save {w.repeated_flops:.4g} FLOP ({share:.1%} of the kernel's counted work)"
    )
