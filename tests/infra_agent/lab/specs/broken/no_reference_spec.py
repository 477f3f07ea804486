from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec, Variant

SPEC = KernelSpec(
    name="no_ref",
    kernel=lambda x, *, precision="fp32": x,
    reference=None,
    inputs=lambda shape, dtype, seed, device: {"x": torch.zeros(shape["N"], dtype=dtype, device=device)},
    shapes=[{"N": 4}],
)
