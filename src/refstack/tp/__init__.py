"""Tensor parallelism for refstack: ``refstack serve --tp N``.

- ``checks``: which launches can run (one line naming the knob when one cannot);
- ``comm``: the collectives (gloo / NCCL), each a span of its own;
- ``shard``: one rank's slice of the model (heads, experts, vocabulary);
- ``step``: the step message rank 0 broadcasts;
- ``rank``: a rank's shard and cache, and the loop of ranks 1..N-1;
- ``group``: rank 0, ``TPModel``, the model the engine drives.

Imported lazily by the server: torch.distributed is needed only under ``--tp``.
"""

from __future__ import annotations

from refstack.tp.checks import TPConfigError, check_tp, tp_problem, uses_tp

__all__ = ["TPConfigError", "check_tp", "tp_problem", "uses_tp"]
