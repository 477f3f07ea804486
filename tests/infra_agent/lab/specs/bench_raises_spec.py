"""A kernel that passes its check but raises while it is timed.

The kernel keeps a step count of its own across calls (as a decode loop's position
would), and its guard raises once the count passes ``MAX_STEPS``.  The check calls it
once, so it is correct there; the timing calls it many times, and it raises in the
warm-up: the lab must report the run as failed, not as ok with a finding nobody reads.
(Each timed call gets fresh inputs, so the guard cannot be on the inputs' values.)
"""

from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec


def inputs(shape, dtype, seed, device):
    return {"state": torch.ones(shape["N"], dtype=dtype, device=device)}


MAX_STEPS = 4
_steps = [0]


def step(state, *, precision="fp32"):
    _steps[0] += 1
    if _steps[0] > MAX_STEPS:
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
