"""A split-K GEMM whose partial sums are reduced through a GEMM in the same precision
mode (a ones-vector matmul).  Under fp32 that reduction is exact enough; under tf32 it
truncates every partial sum to 10 mantissa bits, so the variant drifts from the
unpartitioned kernel.  The lab must catch it under tf32 and not under fp32.
"""

from __future__ import annotations

import torch

from infra_agent.lab.numerics import ieee_fp32, tf32_truncate
from infra_agent.lab.spec import KernelSpec, Tolerance, Variant


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(shape["M"], shape["K"], generator=g).to(device, dtype),
        "b": torch.randn(shape["K"], shape["N"], generator=g).to(device, dtype),
    }


def matmul(a, b, *, precision="fp32"):
    # tf32 is emulated by truncating the operands; the GEMM itself is fp32 on any device.
    with ieee_fp32():
        if precision == "tf32":
            return tf32_truncate(a) @ tf32_truncate(b)
        return a @ b


def split_k_gemm_reduce(a, b, *, precision="fp32", splits=4):
    ks = a.shape[1] // splits
    parts = torch.stack([matmul(a[:, i * ks:(i + 1) * ks], b[i * ks:(i + 1) * ks], precision=precision) for i in range(splits)])
    m, n = parts.shape[1:]
    ones = torch.ones(1, splits, device=parts.device, dtype=parts.dtype)
    # The bug: the reduction itself goes through matmul(..., precision), rounding partials.
    return matmul(ones, parts.reshape(splits, m * n), precision=precision).reshape(m, n)


SPEC = KernelSpec(
    name="matmul_splitk_bug",
    kernel=matmul,
    reference=lambda a, b: a.double() @ b.double(),
    inputs=inputs,
    shapes=[{"M": 32, "N": 32, "K": 256}],
    precisions=("fp32", "tf32"),
    tolerances={"fp32": Tolerance(rel_fro=1e-6), "tf32": Tolerance(rel_fro=2e-3)},
    variants=[Variant("split_k4_gemm_reduce", split_k_gemm_reduce)],
    partition_tolerances={"fp32": Tolerance(rel_fro=1e-6), "tf32": Tolerance(rel_fro=1e-6)},
    flops=lambda s: 2.0 * s["M"] * s["N"] * s["K"],
)
