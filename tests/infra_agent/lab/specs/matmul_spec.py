"""A GEMM with emulated precision modes and three partitionings that must agree.

Used by the kernel-lab tests; also the smallest worked example of the spec API.
"""

from __future__ import annotations

import torch

from infra_agent.lab.numerics import ieee_fp32, split_3xtf32, tf32_truncate
from infra_agent.lab.spec import KernelSpec, Tolerance, Variant


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape["M"], shape["K"], generator=g)
    b = torch.randn(shape["K"], shape["N"], generator=g)
    return {"a": a.to(device=device, dtype=dtype), "b": b.to(device=device, dtype=dtype)}


def matmul(a, b, *, precision="fp32"):
    # Every mode is emulated on rounded operands with fp32 GEMMs, on any device.
    a, b = a.float(), b.float()
    with ieee_fp32():
        if precision == "tf32":
            return tf32_truncate(a) @ tf32_truncate(b)
        if precision == "3xtf32":
            ab, as_ = split_3xtf32(a)
            bb, bs = split_3xtf32(b)
            return as_ @ bb + ab @ bs + ab @ bb
        if precision == "bf16":
            return a.bfloat16().float() @ b.bfloat16().float()
        return a @ b


def reference(a, b):
    return a.double() @ b.double()


def split_k(a, b, *, precision="fp32", splits=4):
    ks = a.shape[1] // splits
    parts = [matmul(a[:, i * ks:(i + 1) * ks], b[i * ks:(i + 1) * ks], precision=precision) for i in range(splits)]
    return torch.stack(parts).sum(0)


def col_shard(a, b, *, precision="fp32", shards=2):
    # Column-parallel TP: each rank owns N/shards columns of b; outputs are gathered.
    return torch.cat([matmul(a, bs, precision=precision) for bs in b.chunk(shards, dim=1)], dim=1)


def row_shard(a, b, *, precision="fp32", shards=2):
    # Row-parallel TP: each rank owns K/shards rows of b; partial outputs are all-reduced.
    parts = [matmul(ah, bh, precision=precision) for ah, bh in zip(a.chunk(shards, dim=1), b.chunk(shards, dim=0))]
    return torch.stack(parts).sum(0)


def _f32_bytes(s, dt):
    return (s["M"] * s["K"] + s["K"] * s["N"] + s["M"] * s["N"]) * torch.empty((), dtype=dt).element_size()


# Partitions see the same (already rounded) operands as the unpartitioned GEMM, and
# TF32 products are exact in fp32, so only summation order differs: fp32 roundoff.
REORDER = Tolerance(rel_fro=1e-6)

SPEC = KernelSpec(
    name="matmul",
    kernel=matmul,
    reference=reference,
    inputs=inputs,
    shapes=[{"M": 32, "N": 24, "K": 256}, {"M": 17, "N": 9, "K": 64}],
    precisions=("fp32", "tf32", "3xtf32", "bf16"),
    tolerances={
        "fp32": Tolerance(rel_fro=1e-6),
        "3xtf32": Tolerance(rel_fro=1e-5),
        "tf32": Tolerance(rel_fro=2e-3),
        "bf16": Tolerance(rel_fro=1e-2),
    },
    variants=[
        Variant("split_k4", split_k, applies=lambda s: s["K"] % 4 == 0),
        Variant("col_shard2", col_shard, applies=lambda s: s["N"] % 2 == 0),
        Variant("row_shard2", row_shard, applies=lambda s: s["K"] % 2 == 0),
    ],
    partition_tolerances={p: REORDER for p in ("fp32", "tf32", "3xtf32")} | {"bf16": Tolerance(rel_fro=1e-6)},
    flops=lambda s: 2.0 * s["M"] * s["N"] * s["K"],
    bytes_moved=_f32_bytes,
    bench_shapes=[{"M": 64, "N": 64, "K": 64}],
)
