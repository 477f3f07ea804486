"""Kernel-lab specs for refstack's native CPU kernels (``refstack.kernels.cpu_kernels``).

Three specs at the ``small`` preset's decode shapes, each kernel against a float64
truth, and against it (``vs kernel``) the forms the engine could run instead:

- ``decode_gemm``: the packed GEMM; ``rows_split`` (the rows in two calls) must be
  **bit-identical** (a row never depends on its neighbours: batch invariance), and
  ``mkl`` (torch's ``x @ w``) equal to fp32 summation order;
- ``moe_experts``: one MoE layer's SwiGLU experts over rows grouped by expert; torch's
  ``grouped`` and ``padded`` layouts;
- ``kda_scan``: the KDA recurrence over T tokens; torch's ``chunked`` form;
- ``decode_gemm_bf16``: the bf16 GEMM (``dtype=bfloat16``) against float64 on the
  bf16-rounded operands; ``rows_split`` bit-identical again, torch's bf16 matmul (its
  output rounded to bf16) and the fp32 kernel on the unrounded operands (how far bf16
  moves a projection) as variants.

``bench`` times the kernel and every variant on the same inputs, on a roofline whose
ceilings were measured in the same run, so the lab answers "native or MKL, at this
shape?" before any deployment.  Needs a C compiler (the kernels build on first use).

    infra-agent kernel check examples/cpu-kernels/spec.py --device cpu
    infra-agent kernel bench examples/cpu-kernels/spec.py --device cpu
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from infra_agent.lab.spec import KernelSpec, Tolerance, Variant
from refstack.kernels import cpu_kda, cpu_kernels, cpu_moe
from refstack.model.kda_ops import kda_chunked, kda_naive
from refstack.model.moe import swiglu_experts

FP32_TRUTH = {"fp32": Tolerance(rel_fro=1e-5)}
# Another summation order of the same fp32 products (measured: ~1e-7 at K=512).
FP32_ORDER = {"fp32": Tolerance(rel_fro=1e-6)}
BIT_EXACT = {"fp32": Tolerance(atol=0.0, rtol=0.0)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- decode GEMM

def gemm_inputs(shape: Mapping[str, int], dtype: torch.dtype, seed: int, device: str,
                pack_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    w = torch.randn(shape["K"], shape["N"], generator=g) * shape["K"] ** -0.5
    return {"x": torch.randn(shape["M"], shape["K"], generator=g), "w": w, "packed": cpu_kernels.pack(w, pack_dtype)}


def gemm(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, **_: Any) -> torch.Tensor:
    return cpu_kernels.gemm(x, packed, w.shape[1])


def gemm_rows_split(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, **_: Any) -> torch.Tensor:
    half = x.shape[0] // 2
    return torch.cat([cpu_kernels.gemm(x[:half], packed, w.shape[1]), cpu_kernels.gemm(x[half:], packed, w.shape[1])])


DECODE_GEMM = KernelSpec(
    name="decode_gemm",
    kernel=gemm,
    reference=lambda x, w, packed: x.double() @ w.double(),
    inputs=gemm_inputs,
    shapes=[{"M": m, "K": 512, "N": n} for m in (1, 8, 32) for n in (512, 900)],
    tolerances=FP32_TRUTH,
    variants=[
        Variant("rows_split", gemm_rows_split, applies=lambda s: s["M"] >= 2, tolerances=BIT_EXACT,
                description="rows in two calls: must be bit-identical"),
        Variant("mkl", lambda x, w, packed, **_: x @ w, description="torch's matmul (MKL)"),
    ],
    partition_tolerances=FP32_ORDER,
    flops=lambda s: 2 * s["M"] * s["K"] * s["N"],
    bytes_moved=lambda s, dt: 4 * (s["K"] * s["N"] + s["M"] * (s["K"] + s["N"])),
    description="x [M, K] @ W [K, N] over W packed in 32-column blocks",
)


# ---------------------------------------------------------------- MoE experts

def moe_inputs(shape: Mapping[str, int], dtype: torch.dtype, seed: int, device: str) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    E, D, inner, T, k = shape["E"], shape["D"], shape["I"], shape["T"], shape["k"]
    w_gate_up = torch.randn(E, D, 2 * inner, generator=g) * D**-0.5
    w_down = torch.randn(E, inner, D, generator=g) * inner**-0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    counts = torch.bincount(ids.flatten(), minlength=E)
    return {"rows": torch.randn(T * k, D, generator=g), "counts": counts, "w_gate_up": w_gate_up, "w_down": w_down,
            "gate_up": cpu_kernels.pack_gate_up(w_gate_up), "down": cpu_kernels.pack_down(w_down)}


def moe_native(rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, **_: Any) -> torch.Tensor:
    return cpu_moe.moe_experts(rows, counts.tolist(), gate_up, down)


def moe_reference(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  **_: Any) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        gate, up = (rows[start : start + c].double() @ w_gate_up[e].double()).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ w_down[e].double())
        start += c
    return torch.cat(out)


def moe_torch_padded(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     **_: Any) -> torch.Tensor:
    c = counts.tolist()
    padded = rows.new_zeros(len(c), max(c), rows.shape[1])
    starts = [sum(c[:e]) for e in range(len(c))]
    for e, n in enumerate(c):
        padded[e, :n] = rows[starts[e] : starts[e] + n]
    out = swiglu_experts(padded, c, w_gate_up, w_down)
    return torch.cat([out[e, :n] for e, n in enumerate(c)])


MOE_EXPERTS = KernelSpec(
    name="moe_experts",
    kernel=moe_native,
    reference=moe_reference,
    inputs=moe_inputs,
    shapes=[{"E": 8, "D": 512, "I": 256, "k": 2, "T": t} for t in (1, 8, 32)],
    tolerances=FP32_TRUTH,
    variants=[
        Variant("torch_grouped", lambda rows, counts, w_gate_up, w_down, **_: swiglu_experts(
            rows, counts.tolist(), w_gate_up, w_down), description="one torch GEMM pair per active expert"),
        Variant("torch_padded", moe_torch_padded, description="one padded batched GEMM pair (torch.bmm)"),
    ],
    partition_tolerances=FP32_ORDER,
    flops=lambda s: 2 * s["T"] * s["k"] * 3 * s["D"] * s["I"],
    bytes_moved=lambda s, dt: 4 * (min(s["E"], s["T"] * s["k"]) * 3 * s["D"] * s["I"] + 2 * s["T"] * s["k"] * s["D"]),
    description="SwiGLU experts over rows grouped by expert (gate|up, silu, down)",
)


# ---------------------------------------------------------------- KDA recurrence

def kda_inputs(shape: Mapping[str, int], dtype: torch.dtype, seed: int, device: str) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    B, T, H, K, V = shape["B"], shape["T"], shape["H"], shape["K"], shape["V"]
    return {
        "q": F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
        "k": F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1),
        "v": torch.randn(B, T, H, V, generator=g),
        "g": -torch.rand(B, T, H, K, generator=g) * 0.3,
        "beta": torch.sigmoid(torch.randn(B, T, H, generator=g)),
        "state": torch.randn(B, H, K, V, generator=g) * 0.1,
    }


def kda_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
    final = state.clone()
    return cpu_kda.kda_scan(q, k, v, g, beta, final, q.shape[-1] ** -0.5), final


def kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    runs = [kda_naive(*(t[b].double() for t in (q, k, v, g, beta, state)), q.shape[-1] ** -0.5) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in runs]), torch.stack([s for _, s in runs])


KDA_SCAN = KernelSpec(
    name="kda_scan",
    kernel=kda_native,
    reference=kda_reference,
    inputs=kda_inputs,
    shapes=[{"B": b, "T": t, "H": 4, "K": 64, "V": 64} for b, t in ((32, 1), (8, 32), (1, 100))],
    tolerances=FP32_TRUTH,
    variants=[
        Variant("chunked", lambda q, k, v, g, beta, state, **_: kda_chunked(q, k, v, g, beta, state, q.shape[-1] ** -0.5, 16),
                description="torch's chunkwise-parallel form (the torch path's prefill)"),
    ],
    # A different algorithm (the UT transform, a triangular solve per chunk), same fp32
    # inputs: measured rel_fro 1.3-2.3e-7 at these shapes.
    partition_tolerances=FP32_ORDER,
    flops=lambda s: 2 * s["B"] * s["T"] * s["H"] * 3 * s["K"] * s["V"],
    bytes_moved=lambda s, dt: 4 * s["B"] * s["H"] * (2 * s["K"] * s["V"] + s["T"] * (3 * s["K"] + 2 * s["V"] + 1)),
    description="the KDA gated delta rule over T tokens, state [B, H, K, V] updated in place",
)

# ---------------------------------------------------------------- bf16 decode GEMM

def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


DECODE_GEMM_BF16 = KernelSpec(
    name="decode_gemm_bf16",
    kernel=gemm,
    # bf16 x bf16 products are exact in fp32 (and float64): the truth is the exact sum.
    reference=lambda x, w, packed: _bf16(x) @ _bf16(w),
    inputs=functools.partial(gemm_inputs, pack_dtype=torch.bfloat16),
    shapes=[{"M": m, "K": 512, "N": n} for m in (1, 8, 32) for n in (512, 900)],
    tolerances=FP32_TRUTH,
    variants=[
        Variant("rows_split", gemm_rows_split, applies=lambda s: s["M"] >= 2, tolerances=BIT_EXACT,
                description="rows in two calls: must be bit-identical"),
        # Its output is rounded to bf16 too: half a bf16 step, 2^-9 relative, at most.
        Variant("torch_bf16", lambda x, w, packed, **_: (x.to(torch.bfloat16) @ w.to(torch.bfloat16)).float(),
                tolerances={"fp32": Tolerance(rel_fro=2.0**-9)}, description="torch's bf16 matmul, bf16 out"),
        # Both operands unrounded: each product moves by up to 2^-8 relative, independent
        # errors over K = 512 terms average to well under 1%.
        Variant("fp32_native", lambda x, w, packed, **_: cpu_kernels.gemm(x, cpu_kernels.pack(w), w.shape[1]),
                tolerances={"fp32": Tolerance(rel_fro=1e-2)}, description="the fp32 kernel on the unrounded operands"),
    ],
    partition_tolerances=FP32_ORDER,
    flops=lambda s: 2 * s["M"] * s["K"] * s["N"],
    bytes_moved=lambda s, dt: 2 * s["K"] * s["N"] + 4 * s["M"] * (s["K"] + s["N"]),
    description="bf16(x) [M, K] @ W [K, N] over W packed as bf16 k-pairs, fp32 accumulation",
)

SPECS = [DECODE_GEMM, MOE_EXPERTS, KDA_SCAN, DECODE_GEMM_BF16]
