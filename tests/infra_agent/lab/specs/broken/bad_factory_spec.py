from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec


def inputs(shape, dtype, seed, device):
    # Bug: reads a dimension the shape cases do not declare.
    return {"x": torch.zeros(shape["N"], shape["M"], dtype=dtype, device=device)}


SPEC = KernelSpec(
    name="bad_factory",
    kernel=lambda x, *, precision="fp32": x,
    reference=lambda x: x,
    inputs=inputs,
    shapes=[{"N": 4}],
)
