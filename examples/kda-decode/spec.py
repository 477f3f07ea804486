"""Kernel-lab spec for refstack's Triton KDA decode step (case study C).

    infra-agent kernel check examples/kda-decode/spec.py                 # on a GPU
    infra-agent kernel bench examples/kda-decode/spec.py
    TRITON_INTERPRET=1 infra-agent kernel check examples/kda-decode/spec.py --device cpu

The truth is the float64 PyTorch step (``refstack.kernels.kda_decode_ref``).  The
kernel is the ``fused`` form (one program per sequence and head); the variants are
the ``tiled`` form (one program per V tile of 32 columns, fla-core's layout) and
fla-core's ``fused_recurrent_kda`` when it is installed.  Each form's ``work`` hook
runs the kernel with its per-(sequence, head) counters on, so the lab's accounting
reads from the kernel itself how often the norm and gate were computed: four times
per (sequence, head) in the tiled form at V=128, once in the fused one.

Under the Triton interpreter (the CPU), the shapes shrink to what it runs in seconds.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch

from infra_agent.lab.spec import KernelSpec, Tolerance, Variant
from infra_agent.lab.tiled_kda import gate_flops, norm_flops, tile_flops
from infra_agent.lab.work import WorkCounter
from refstack.kernels.kda_decode_ref import kda_decode_inputs, kda_decode_reference


def _kernel_module(device: torch.device) -> Any:
    # Checked where the kernel runs: the lab may build inputs on the CPU and move them.
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the KDA decode kernel is Triton: on the CPU, run with TRITON_INTERPRET=1 set")
    import refstack.kernels.kda_decode as mod  # triton; imported only when a form runs

    return mod


def _inputs(shape, dtype, seed, device):  # type: ignore[no-untyped-def]
    x = kda_decode_inputs(shape["N"], shape["H"], shape["K"], shape["V"], num_slots=2 * shape["N"], dtype=dtype,
                          device=device, seed=seed)
    return x


def _reference(q, k, v, f, b, state, slots, A_log, dt_bias):  # type: ignore[no-untyped-def]
    o, s = kda_decode_reference(q, k, v, f, b, state, slots, A_log=A_log, dt_bias=dt_bias)
    return {"o": o, "state": s}


def _ours(q, k, v, f, b, state, slots, A_log, dt_bias, *, form, precision="fp32", counter: WorkCounter | None = None):  # type: ignore[no-untyped-def]
    N, H, K = q.shape
    counts = torch.zeros(N * H, dtype=torch.int32, device=q.device) if counter is not None else None
    o = _kernel_module(q.device).kda_decode(q, k, v, f, b, state, slots, A_log=A_log, dt_bias=dt_bias, form=form, counts=counts)
    if counter is not None:
        per_key = counts.view(N, H)
        counter.add_counts("l2norm_qk", per_key, norm_flops(K))
        counter.add_counts("gate", per_key, gate_flops(K))
        counter.add("state_update", tile_flops(K, v.shape[-1]) * N * H)
    return o


def _fla(q, k, v, f, b, state, slots, A_log, dt_bias, *, precision="fp32"):  # type: ignore[no-untyped-def]
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    n, h, kk = q.shape
    o, _ = fused_recurrent_kda_fwd(
        q=q.view(n, 1, h, kk), k=k.view(n, 1, h, kk), v=v.view(n, 1, h, -1), g=f.view(n, 1, h, kk),
        beta=b.view(n, 1, h), A_log=A_log, dt_bias=dt_bias, initial_state=state, scale=kk**-0.5,
        inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    return o.view(n, h, -1)


def _picked(o, inputs):  # type: ignore[no-untyped-def]
    # Both kernels update the state pool in place: the sequences' rows are read out here,
    # after the call, so the timed call is the kernel alone (a gather of the rows inside
    # it would double the bytes moved).
    return {"o": o, "state": inputs["state"].index_select(0, inputs["slots"].long())}


def _fla_installed() -> bool:
    try:
        import fla.ops.kda.fused_recurrent  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken: the variant is left out
        return False
    return True


def _bytes(shape, dtype):  # type: ignore[no-untyped-def]
    N, H, K, V = shape["N"], shape["H"], shape["K"], shape["V"]
    el = torch.empty((), dtype=dtype).element_size()
    return N * H * (2 * K * V * 4 + (3 * K + 2 * V + 1) * el)


def _flops(shape):  # type: ignore[no-untyped-def]
    N, H, K, V = shape["N"], shape["H"], shape["K"], shape["V"]
    return N * H * (norm_flops(K) + gate_flops(K) + tile_flops(K, V))


def specs() -> list[KernelSpec]:
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    shapes = ([{"N": 3, "H": 2, "K": 32, "V": 128}] if interpreted else
              [{"N": n, "H": 32, "K": 128, "V": 128} for n in (8, 128, 512)])
    variants = [Variant("tiled", partial(_ours, form="tiled"), work=partial(_ours, form="tiled"))]
    if _fla_installed() and not interpreted:
        variants.append(Variant("fla-core", _fla))
    return [KernelSpec(
        name="kda_decode",
        kernel=partial(_ours, form="fused"),
        reference=_reference,
        outputs=_picked,
        inputs=_inputs,
        shapes=shapes,
        dtypes=(torch.float32,),
        precisions=("fp32",),
        tolerances={"fp32": Tolerance(rel_fro=1e-5)},
        out_dtypes=lambda dt, p: {"o": dt, "state": torch.float32},
        variants=variants,
        # V columns are independent: the forms differ only in the order of the sums
        # over K inside a tile, and fla-core in its L2-norm epsilon placement.
        partition_tolerances={"fp32": Tolerance(rel_fro=1e-5)},
        work=partial(_ours, form="fused"),
        flops=_flops,
        bytes_moved=_bytes,
    )]
