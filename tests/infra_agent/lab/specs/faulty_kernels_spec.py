"""Kernels that misbehave in every way the lab must survive: raise, NaN, Inf, wrong
shape, wrong dtype; and a good kernel whose partition variant returns NaN."""

from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec, Tolerance, Variant


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(shape["N"], generator=g).to(device, dtype)}


def reference(x):
    return x.double() * 2


def good(x, *, precision="fp32"):
    return x * 2


def raises(x, *, precision="fp32"):
    raise RuntimeError("illegal memory access (simulated)")


def nan_at_3(x, *, precision="fp32"):
    y = x * 2
    y[3] = float("nan")
    return y


def inf_at_5(x, *, precision="fp32"):
    y = x * 2
    y[5] = float("inf")
    return y


def wrong_shape(x, *, precision="fp32"):
    return (x * 2)[:-1]


def wrong_dtype(x, *, precision="fp32"):
    return (x * 2).double()


def returns_none(x, *, precision="fp32"):
    return None


def _spec(name, kernel, variants=()):
    return KernelSpec(
        name=name,
        kernel=kernel,
        reference=reference,
        inputs=inputs,
        shapes=[{"N": 16}],
        tolerances={"fp32": Tolerance(rtol=1e-6, atol=1e-6)},
        variants=variants,
    )


def specs():
    return [
        _spec("raises", raises),
        _spec("nan", nan_at_3),
        _spec("inf", inf_at_5),
        _spec("wrong_shape", wrong_shape),
        _spec("wrong_dtype", wrong_dtype),
        _spec("returns_none", returns_none),
        _spec("good_with_nan_variant", good, [Variant("nan_shard", nan_at_3), Variant("ok_shard", good)]),
    ]
