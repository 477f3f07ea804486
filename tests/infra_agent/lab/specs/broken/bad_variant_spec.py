from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec, Variant

SPEC = KernelSpec(
    name="bad_variant",
    kernel=lambda x, *, precision="fp32": x,
    reference=lambda x: x,
    inputs=lambda shape, dtype, seed, device: {"x": torch.zeros(shape["N"], dtype=dtype, device=device)},
    shapes=[{"N": 4}],
    # applies() reads a dimension the shapes do not have.
    variants=[Variant("split_k2", lambda x, *, precision="fp32": x, applies=lambda s: s["K"] % 2 == 0)],
)
