"""An in-place kernel: a row-indexed state pool updated through slot indices.

``kernel`` returns only its output; ``outputs`` reads the updated rows after the call.
``wrong_row`` writes the update into the next slot, which only the picked rows show.
``PICKS`` counts the ``outputs`` calls, so a test can see that timing never runs it.
"""

from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec, Tolerance, Variant

PICKS = {"n": 0}


def _inputs(shape, dtype, seed, device):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    n, d, slots = shape["N"], shape["D"], 2 * shape["N"]
    return {"x": torch.randn(n, d, generator=g, dtype=dtype).to(device),
            "pool": torch.randn(slots, d, generator=g, dtype=dtype).to(device),
            "slots": torch.randperm(slots, generator=g)[:n].to(device)}


def _reference(x, pool, slots):  # type: ignore[no-untyped-def]
    new = 0.5 * pool.double()[slots] + x.double()
    return {"y": new.sum(-1).to(x.dtype), "pool": new.to(pool.dtype)}


def _kernel(x, pool, slots, precision="fp32"):  # type: ignore[no-untyped-def]
    pool[slots] = 0.5 * pool[slots] + x
    return pool[slots].sum(-1)


def _wrong_row(x, pool, slots, precision="fp32"):  # type: ignore[no-untyped-def]
    y = (0.5 * pool[slots] + x).sum(-1)
    shifted = (slots + 1) % pool.shape[0]
    pool[shifted] = 0.5 * pool[slots] + x
    return y


def _picked(y, inputs):  # type: ignore[no-untyped-def]
    PICKS["n"] += 1
    return {"y": y, "pool": inputs["pool"][inputs["slots"]]}


SPEC = KernelSpec(
    name="inplace_rows",
    kernel=_kernel,
    reference=_reference,
    outputs=_picked,
    inputs=_inputs,
    shapes=[{"N": 4, "D": 16}],
    tolerances={"fp32": Tolerance(rel_fro=1e-6)},
    partition_tolerances={"fp32": Tolerance(rel_fro=1e-6)},
    variants=[Variant("wrong_row", _wrong_row)],
)
