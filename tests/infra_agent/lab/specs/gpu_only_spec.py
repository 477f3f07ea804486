"""A GPU-only spec: on the CPU every case is skipped and nothing is checked."""

from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec

SPEC = KernelSpec(
    name="gpu_only",
    kernel=lambda x, *, precision="fp32": x * 2,
    reference=lambda x: x * 2,
    inputs=lambda shape, dtype, seed, device: {"x": torch.ones(shape["N"], dtype=dtype, device=device)},
    shapes=[{"N": 8}],
    gpu_only=True,
)
