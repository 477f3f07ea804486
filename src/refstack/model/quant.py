"""W8A8: SmoothQuant-style int8 weights and activations (the ``quantization=w8a8`` knob).

What is quantised: the Linears of attention (``qkv_proj``, ``o_proj``), the KDA input and
output projections (``in_proj``, ``o_proj``) and the experts (gate|up, down).  Weights are
int8 per output channel (symmetric, scale = max |w| / 127); activations are int8 per token
(dynamic, symmetric, scale = max |x| / 127 of the row), and the product is accumulated in
int32 and dequantised in fp32 with the token's scale times the channel's.

Before quantising, SmoothQuant moves part of the activations' range into the weights: per
input channel j, ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (``alpha`` = 0.5), with
max|X_j| measured by a calibration pass at load time (``calibration_prompts``: seeded random
bytes through the byte tokenizer, nothing downloaded), and max|W_j| over every weight that
reads channel j.  ``X W^T = (X diag(1/s)) (W diag(s))^T`` exactly in real arithmetic, so the
weights are scaled by s and the activations divided by s before they are quantised:

- where the Linear follows an RMSNorm, 1/s is folded into the norm's weight (free): the
  mixer norm -> ``qkv_proj`` / ``in_proj``; the MLP norm -> every expert's gate|up (one s for
  all experts; the router reads the same norm and stays in higher precision, so s is folded
  into its weight, ``W_router diag(s)``, which keeps its logits);
- elsewhere (``o_proj`` of both mixers, each expert's down projection) the multiply by 1/s is
  explicit, and rides in the pass that quantises the activations (C: ``quantize_row``).

What stays in higher precision (the model's dtype, fp32 or bf16 GEMMs): the router (it
picks experts: a discrete choice, 0.1% of the FLOPs), the norms, the KDA recurrence and its
state, attention itself, the LM head (the widest output, and its logits are the result),
and the KDA low-rank up-projection (decay and gate): 3% of a KDA layer's weights, and its
output feeds the decay, which the recurrence exponentiates and multiplies into the state at
every step, so an error there compounds along the sequence rather than staying in one token.
And the *held sites* (``quant_recipe.HELD_SITES``): six projections of the first layers, whose
error passes every later router and the KDA recurrence; they run as ``HeldLinear`` (or keep
their bf16 experts), unsmoothed.

Kernels: on the native CPU kernels ``cpu_int8.c`` (VNNI ``vpdpbusd`` with a portable path
that gives the same integers); on CUDA with Triton installed ``refstack.kernels.w8a8_triton``
(quantise, int8 product and dequantise in one launch per GEMM, and one launch for all of a
padded MoE buffer's experts); otherwise ``torch._int_mm`` (CPU, or CUDA without Triton).  All
quantise the activations the same way, bit for bit (``quant_ops.quantize_rows`` mirrors the
C code and the Triton kernel mirrors it).

Code: this module calibrates, smooths and quantises a model (``quantize_model``, and
``apply_quantization``, the engine's entry point); ``quant_recipe`` holds the recipe (the
calibration prompts, the factors, the sites and which are held); ``quant_layers`` the modules
a quantised model runs; ``quant_ops`` their int8 arithmetic and which GEMM backend runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from refstack.model import quant_ops
from refstack.model.quant_layers import HeldLinear, QuantizedExperts, QuantizedLinear
from refstack.model.quant_recipe import (
    ALPHA,
    HELD_SITES,
    calibrate,
    calibration_prompts,
    mixer_linears,
    resolve_held,
    site_names,
    smoothing_factors,
)

__all__ = [  # the recipe's names are re-exported: callers import them from here
    "ALPHA", "HELD_SITES", "QuantReport", "apply_quantization", "calibrate", "calibration_prompts", "quantize_model",
    "resolve_held", "site_names", "smooth_and_quantize", "smoothing_factors",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantReport:
    """What ``quantize_model`` did (logged; also for the benchmark and tests)."""

    alpha: float
    calibration_tokens: int
    linears: int  # quantised Linears
    expert_layers: int  # quantised MoE layers
    int8_weight_bytes: int  # the int8 codes (scales and factors not counted)
    s_range: tuple[float, float]  # smallest and largest smoothing factor over the quantised sites
    held: tuple[str, ...] = ()  # sites left in the model's precision, "<layer>.<site>"


@torch.inference_mode()
def smooth_and_quantize(model: Any, stats: dict[str, Tensor], alpha: float = ALPHA, tokens: int = 0,
                        held: tuple[str, ...] | None = ()) -> QuantReport:
    """Fold the smoothing factors (see the module doc) and attach the int8 copies:
    ``Linear.w8a8`` and ``MoE.w8a8``.  Irreversible: the norms and the router are rescaled.
    ``held`` sites (None: ``HELD_SITES``) are neither smoothed nor quantised: their Linears get
    a ``HeldLinear``, their experts stay as they are."""
    names = {id(m): n for n, m in model.named_modules()}
    keep = resolve_held(len(model.layers), held)
    s_all: list[Tensor] = []
    linears = experts = nbytes = 0
    for i, layer in enumerate(model.layers):
        mixer, moe = layer.mixer, layer.moe
        first, o_proj = mixer_linears(mixer)
        if f"{i}.mixer_in" in keep:
            first.w8a8 = HeldLinear(first.weight, first.bf16)
        else:  # mixer norm -> qkv_proj / in_proj (folded)
            s = smoothing_factors(stats[names[id(first)]], first.weight.abs().amax(0), alpha)
            layer.mixer_norm.weight.div_(s)
            first.weight.mul_(s[None, :])
            first.w8a8 = QuantizedLinear(first.weight, None)
            s_all.append(s)
            linears += 1
            nbytes += first.weight.numel()
        if f"{i}.mixer_out" in keep:
            o_proj.w8a8 = HeldLinear(o_proj.weight, o_proj.bf16)
        else:  # o_proj: explicit 1/s in the activation quantisation
            s_o = smoothing_factors(stats[names[id(o_proj)]], o_proj.weight.abs().amax(0), alpha)
            o_proj.w8a8 = QuantizedLinear(o_proj.weight * s_o[None, :], 1.0 / s_o)
            s_all.append(s_o)
            linears += 1
            nbytes += o_proj.weight.numel()
        if f"{i}.experts" in keep:
            continue  # MoE.w8a8 stays None: the experts keep their own (bf16 / fp32) packs
        # MLP norm -> every expert's gate|up (folded); the router keeps its logits via W diag(s)
        name = names[id(moe)]
        w_max = moe.w_gate_up.abs().amax(dim=(0, 2))  # [D]: over experts and output columns
        s_m = smoothing_factors(stats[name + ".x"], w_max, alpha)
        layer.mlp_norm.weight.div_(s_m)
        moe.router.weight.mul_(s_m[None, :])
        moe.w_gate_up.mul_(s_m[None, :, None])
        # each expert's down projection: explicit per-expert 1/s
        h_max = stats[name + ".hidden"]  # [E, I]
        s_d = smoothing_factors(h_max, moe.w_down.abs().amax(dim=2), alpha)  # [E, I]
        moe.w8a8 = QuantizedExperts(moe.w_gate_up, moe.w_down * s_d[:, :, None], 1.0 / s_d)
        s_all += [s_m, s_d.reshape(-1)]
        experts += 1
        nbytes += moe.w_gate_up.numel() + moe.w_down.numel()
    flat = torch.cat(s_all) if s_all else torch.ones(1)
    return QuantReport(alpha, tokens, linears, experts, nbytes, (flat.min().item(), flat.max().item()),
                       tuple(s for s in site_names(len(model.layers)) if s in keep))


def quantize_model(model: Any, alpha: float = ALPHA, prompts: list[list[int]] | None = None,
                   held: tuple[str, ...] | None = None) -> QuantReport:
    """Calibrate, smooth and quantise ``model`` (a ``HybridModel``) in place, on its device and
    kernels: the native kernels are switched off for the calibration pass (it reads the
    module path's activations) and back on after, which packs the int8 weights.  ``held``:
    the sites left in the model's precision (None: ``HELD_SITES``; ``()``: none)."""
    if getattr(model, "quantization", "none") == "w8a8":
        raise ValueError("quantize_model: the model is already W8A8")
    native = bool(getattr(model, "native_kernels", False))
    if not native:
        reason = quant_ops.int_mm_unavailable_reason(model.device.type)
        if reason:
            raise ValueError(f"quantization w8a8 on torch's path: {reason}")
    prompts = prompts if prompts is not None else calibration_prompts()
    if native:
        model.use_native_kernels(False)
    try:
        stats = calibrate(model, prompts)
        report = smooth_and_quantize(model, stats, alpha, tokens=sum(map(len, prompts)), held=held)
        model.quantization = "w8a8"
        model.quant_report = report
    finally:
        if native:
            model.use_native_kernels(True)
    log.info("w8a8: %d Linears and %d expert layers quantised, %s held (alpha %.2f, %d calibration tokens, "
             "s in [%.3g, %.3g])", report.linears, report.expert_layers, ",".join(report.held) or "none", alpha,
             report.calibration_tokens, *report.s_range)
    return report


def apply_quantization(model: Any, quantization: str) -> QuantReport | None:
    """The engine's entry point (``EngineConfig.quantization``): quantise a model that is not
    yet (a model shared by several engines is quantised once), refuse a mismatch."""
    current = getattr(model, "quantization", "none")
    if quantization == "none":
        if current != "none":
            raise ValueError(f"EngineConfig.quantization='none' but the model given is already {current!r}")
        return None
    if quantization != "w8a8":
        raise ValueError(f"unknown quantization {quantization!r}")
    if current == "w8a8":
        report: QuantReport | None = getattr(model, "quant_report", None)
        return report
    if not hasattr(model, "layers") or not hasattr(model, "forward_chunks"):
        raise ValueError("quantization w8a8 needs refstack's HybridModel")
    return quantize_model(model)

