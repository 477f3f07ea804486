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
quantise the activations the same way, bit for bit (``quantize_rows`` here mirrors the C
code and the Triton kernel mirrors it).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from refstack.kernels import cpu_kernels
from refstack.model.layers import matmul_rows, round_bf16
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
    "ALPHA", "HELD_SITES", "HeldLinear", "QuantReport", "QuantizedExperts", "QuantizedLinear", "apply_quantization",
    "calibrate", "calibration_prompts", "int_mm", "int_mm_unavailable_reason", "quantize_model", "quantize_rows",
    "quantize_weight", "resolve_held", "site_names", "smooth_and_quantize", "smoothing_factors",
]

log = logging.getLogger(__name__)

QMAX = 127


# ---------------------------------------------------------------- quantisers
def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] -> int8 codes [N, K] and fp32 scales [N]: symmetric, per output channel (row)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_rows(x: Tensor, inv_s: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] (times ``inv_s`` [K] when given) -> int8 codes [M, K] and fp32 scales [M]:
    symmetric, per row (per token): scale = max |x| / 127, codes = round(x * (1 / scale)),
    half to even.  The same arithmetic as the native kernels' ``quantize_row``
    (``cpu_kernels.int8_quantize``), bit for bit."""
    xs = x.float() * inv_s if inv_s is not None else x.float()
    scale = xs.abs().amax(dim=1) / QMAX
    recip = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))  # one divide per row, as the kernel
    q = torch.round(xs * recip[:, None]).clamp_(-QMAX, QMAX)
    q = torch.where((scale > 0)[:, None], q, torch.zeros_like(q))
    return q.to(torch.int8), scale


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a [M, K] @ b [K, N]``, int8 in, exact int32 out, through ``torch._int_mm``.

    On CUDA, ``_int_mm`` wants more than 16 rows and K and N multiples of 8: the rows are
    padded here (``b`` must come padded, see ``QuantizedLinear._mm_weight``).  Untested
    here: the project's GPU tests are skipped without a device."""
    if a.is_cuda:
        M, K = a.shape
        Kb = b.shape[0]
        rows = max(32, -(-M // 8) * 8)
        if rows != M or Kb != K:
            a = F.pad(a, (0, Kb - K, 0, rows - M))
        return torch._int_mm(a, b)[:M]
    return torch._int_mm(a, b)


@functools.cache
def int_mm_unavailable_reason(device: str = "cpu") -> str | None:
    """None when ``torch._int_mm`` runs on ``device`` ("cpu" or "cuda") and gives exact
    products on a small probe; else why not (one line)."""
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8)
        b = torch.randint(-127, 128, (64, 32), generator=gen, dtype=torch.int8)
        b_dev = b.to(device)
        if b_dev.is_cuda:  # the column-major operand int_mm passes there
            b_dev = b_dev.t().contiguous().t()
        got = torch._int_mm(a.to(device), b_dev).cpu()
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"torch._int_mm does not run on {device} with torch {torch.__version__} ({str(exc).splitlines()[0]})"
    if got.dtype != torch.int32 or not torch.equal(got.long(), a.long() @ b.long()):
        return f"torch._int_mm gives wrong products on {device} with torch {torch.__version__}"
    return None


@functools.cache
def fused_gpu_kernel() -> Any:
    """``refstack.kernels.w8a8_triton`` (one Triton launch per W8A8 GEMM on CUDA), or None
    where Triton is not installed: CUDA then takes the unfused ``torch._int_mm`` path."""
    try:
        from refstack.kernels import w8a8_triton
    except ImportError:
        log.info("W8A8 on CUDA: triton is not installed; using torch._int_mm and separate quantise/dequantise kernels")
        return None
    return w8a8_triton


def _fused(x: Tensor) -> Any:
    return fused_gpu_kernel() if x.is_cuda else None


def _dequant(acc: Tensor, sx: Tensor, sw: Tensor) -> Tensor:
    """int32 sums -> fp32, times the row scale and the column scale (as the C epilogue)."""
    return acc.float() * (sx[:, None] * sw[None, :])


# ---------------------------------------------------------------- modules
class QuantizedLinear(nn.Module):
    """The int8 copy of a ``Linear``: codes ``qweight_t`` [K, N] (int8, the layout
    ``torch._int_mm`` streams fastest on the CPU), ``scale`` [N], and ``inv_s`` [K] (the
    explicit 1/s, or None when s is folded into a preceding norm)."""

    qweight_t: Tensor
    scale: Tensor
    inv_s: Tensor | None

    def __init__(self, weight: Tensor, inv_s: Tensor | None) -> None:
        """``weight`` [N, K]: the smoothed weight, W diag(s)."""
        super().__init__()
        q, scale = quantize_weight(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("qweight_t", q.t().contiguous(), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("inv_s", None if inv_s is None else inv_s.float().contiguous(), persistent=False)
        self._cuda_b: tuple[torch.device, Tensor] | None = None

    def pack(self) -> Tensor:
        """The native kernels' tagged pack (``cpu_kernels.pack_w8a8``)."""
        return cpu_kernels.pack_w8a8(self.qweight_t.t(), self.scale, self.inv_s)

    def _mm_weight(self) -> Tensor:
        if not self.qweight_t.is_cuda:
            return self.qweight_t
        # cuBLASLt's int8 path: column-major mat2 with K and N multiples of 8 (torchao's layout).
        dev = self.qweight_t.device
        if self._cuda_b is None or self._cuda_b[0] != dev:
            K, N = self.qweight_t.shape
            padded = F.pad(self.qweight_t, (0, -N % 8, 0, -K % 8))
            self._cuda_b = (dev, padded.t().contiguous().t())
        return self._cuda_b[1]

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        fused = _fused(x2)
        if fused is not None:  # one launch on CUDA, the same bits (w8a8_triton)
            return fused.w8a8_matmul(x2, self.qweight_t, self.scale, self.inv_s).view(*x.shape[:-1], self.out_features)
        codes, sx = quantize_rows(x2, self.inv_s)
        acc = int_mm(codes, self._mm_weight())[:, : self.out_features]
        y = _dequant(acc, sx, self.scale)
        return y.view(*x.shape[:-1], self.out_features)


class QuantizedExperts(nn.Module):
    """An MoE layer's experts in int8: gate|up codes [E, 2I, D] with scales [E, 2I] (its input's
    1/s folded into the MLP norm), down codes [E, D, I] with scales [E, D] and the explicit
    per-expert 1/s [E, I] of its input (silu(gate) * up)."""

    q_gate_up: Tensor
    s_gate_up: Tensor
    q_down: Tensor
    s_down: Tensor
    inv_s_down: Tensor

    def __init__(self, w_gate_up: Tensor, w_down: Tensor, inv_s_down: Tensor) -> None:
        """``w_gate_up`` [E, D, 2I] (smoothed), ``w_down`` [E, I, D] (smoothed: rows times s)."""
        super().__init__()
        E = w_gate_up.shape[0]
        gu = [quantize_weight(w_gate_up[e].t()) for e in range(E)]
        dn = [quantize_weight(w_down[e].t()) for e in range(E)]
        self.inner = w_gate_up.shape[2] // 2
        self.register_buffer("q_gate_up", torch.stack([q for q, _ in gu]), persistent=False)
        self.register_buffer("s_gate_up", torch.stack([s for _, s in gu]), persistent=False)
        self.register_buffer("q_down", torch.stack([q for q, _ in dn]), persistent=False)
        self.register_buffer("s_down", torch.stack([s for _, s in dn]), persistent=False)
        self.register_buffer("inv_s_down", inv_s_down.float().contiguous(), persistent=False)
        # Per expert [K, N] int8 operands for torch._int_mm (gate|up, down), made on first use per device.
        self._mm: tuple[torch.device, Tensor, Tensor] | None = None

    def pack(self) -> tuple[Tensor, Tensor]:
        return (cpu_kernels.pack_gate_up_w8a8(self.q_gate_up, self.s_gate_up),
                cpu_kernels.pack_down_w8a8(self.q_down, self.s_down, self.inv_s_down))

    def _operands(self) -> tuple[Tensor, Tensor]:
        dev = self.q_down.device
        if self._mm is None or self._mm[0] != dev:
            self._mm = (dev, _mm_layout(self.q_gate_up), _mm_layout(self.q_down))
        return self._mm[1], self._mm[2]

    def expert(self, e: int, rows: Tensor) -> Tensor:
        """Expert e over rows [n, D]: down(silu(gate) * up), each GEMM W8A8."""
        fused = _fused(rows)
        if fused is not None:  # on CUDA: one launch per GEMM (w8a8_triton)
            return self._fused_pair(fused, rows, slice(e, e + 1))
        b_gu, b_dn = self._operands()
        codes, sx = quantize_rows(rows)
        gu = _dequant(int_mm(codes, b_gu[e])[:, : 2 * self.inner], sx, self.s_gate_up[e])
        gate, up = gu.chunk(2, dim=-1)
        codes, sx = quantize_rows(F.silu(gate).mul_(up), self.inv_s_down[e])
        return _dequant(int_mm(codes, b_dn[e])[:, : self.s_down.shape[1]], sx, self.s_down[e])

    def grouped(self, buf: Tensor, counts: list[int], first: int) -> Tensor:
        """Rows grouped by expert (``counts`` per local expert, experts ``first``...)."""
        out = torch.empty_like(buf)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self.expert(first + e, buf[start : start + n])
                start += n
        return out

    def padded(self, buf: Tensor, first: int) -> Tensor:
        """A padded buffer [E_r, capacity, D] (empty rows are zeros and give zeros)."""
        fused = _fused(buf)
        if fused is not None:  # on CUDA: one launch per GEMM for all the experts
            return self._fused_pair(fused, buf, slice(first, first + buf.shape[0]))
        return torch.stack([self.expert(first + e, buf[e]) for e in range(buf.shape[0])])

    def _fused_pair(self, fused: Any, rows: Tensor, experts: slice) -> Tensor:
        """gate|up, silu(gate) * up and down through ``w8a8_triton`` for ``experts``: rows
        [E, n, D] (or [n, D] for one expert), the unfused path's arithmetic."""
        one = rows.dim() == 2
        x = rows.unsqueeze(0) if one else rows
        gu = fused.w8a8_matmul(x, self.q_gate_up[experts].transpose(1, 2), self.s_gate_up[experts])
        gate, up = gu.chunk(2, dim=-1)
        y = fused.w8a8_matmul(F.silu(gate).mul_(up), self.q_down[experts].transpose(1, 2), self.s_down[experts],
                              self.inv_s_down[experts])
        return y[0] if one else y


def _mm_layout(q: Tensor) -> Tensor:
    """Codes [E, N, K] as per-expert ``torch._int_mm`` operands [E, K, N]: row-major on the CPU
    (its fast layout), column-major with K and N padded to multiples of 8 on CUDA (see ``int_mm``)."""
    if q.is_cuda:
        return F.pad(q, (0, -q.shape[2] % 8, 0, -q.shape[1] % 8)).transpose(1, 2)
    return q.transpose(1, 2).contiguous()


class HeldLinear(nn.Module):
    """A Linear of a W8A8 model left in the model's precision (``HELD_SITES``).  It stands in
    ``Linear.w8a8`` so that the Linear packs it behind the tagged header: a native decode block
    reads all its weights with one kind, and its other weights are int8.  It holds the
    Linear's own weight (no copy)."""

    def __init__(self, weight: Tensor, bf16: bool) -> None:
        super().__init__()
        self.weight = weight  # the Linear's parameter itself: .to(device) moves it in place
        self.bf16 = bf16

    def pack(self) -> Tensor:
        return cpu_kernels.pack(self.weight.t(), torch.bfloat16 if self.bf16 else torch.float32, tagged=True)

    def forward(self, x: Tensor) -> Tensor:  # torch's path: as Linear.forward computes it
        return matmul_rows(round_bf16(x) if self.bf16 else x, self.weight.t())


# ---------------------------------------------------------------- the model
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
        reason = int_mm_unavailable_reason(model.device.type)
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

