"""An in-place kernel that passes its check but raises while it is timed.

The check hands every call a fresh clone of the inputs, so ``state`` starts at 1 and
the kernel is correct.  Timing reuses one set of inputs (as an engine would), so the
state doubles on every call until the kernel's own overflow guard raises: the lab
must report the run as failed, not as ok with a finding nobody reads.
"""

from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec


def inputs(shape, dtype, seed, device):
    return {"state": torch.ones(shape["N"], dtype=dtype, device=device)}


def step(state, *, precision="fp32"):
    if float(state.max()) > 1e3:
        raise RuntimeError("state overflow: called on its own output too often")
    state.mul_(2)
    return state.clone()


SPEC = KernelSpec(
    name="bench_raises",
    kernel=step,
    reference=lambda state: state * 2,
    inputs=inputs,
    shapes=[{"N": 16}],
    flops=lambda s: float(s["N"]),
    bytes_moved=lambda s, dt: 2.0 * s["N"] * torch.empty((), dtype=dt).element_size(),
)
