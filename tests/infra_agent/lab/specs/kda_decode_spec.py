"""KDA-like decode step tiled over V: tile-size variants, each with its work hook."""

from __future__ import annotations

from functools import partial, wraps

import torch

from infra_agent.lab.numerics import ieee_fp32
from infra_agent.lab.spec import KernelSpec, Tolerance, Variant
from infra_agent.lab.tiled_kda import (
    kda_decode_bytes,
    kda_decode_flops,
    kda_decode_inputs,
    kda_decode_reference,
    kda_decode_tiled,
)


def in_fp32(fn):
    """``fn`` with its einsums and matvecs in IEEE fp32 (the spec's only mode) on CUDA too."""

    @wraps(fn)
    def run(*args, **kwargs):
        with ieee_fp32():
            return fn(*args, **kwargs)

    return run


# V columns are independent, so any BV computes the same per-column sums; only the
# BLAS reduction order over K may differ between tile widths.
SAME_COLUMNS = Tolerance(rel_fro=1e-6)

SPEC = KernelSpec(
    name="kda_decode",
    kernel=in_fp32(partial(kda_decode_tiled, BV=32)),
    reference=kda_decode_reference,
    inputs=kda_decode_inputs,
    shapes=[{"N": 2, "H": 2, "K": 32, "V": 128}],
    dtypes=(torch.float32,),
    precisions=("fp32",),
    tolerances={"fp32": Tolerance(rel_fro=1e-5)},
    out_dtypes=lambda dt, p: {"o": dt, "state": torch.float32},
    variants=[
        Variant(f"BV={bv}", in_fp32(partial(kda_decode_tiled, BV=bv)), work=partial(kda_decode_tiled, BV=bv))
        for bv in (16, 64, 128)
    ],
    partition_tolerances={"fp32": SAME_COLUMNS},
    work=partial(kda_decode_tiled, BV=32),
    flops=kda_decode_flops,
    bytes_moved=kda_decode_bytes,
)
