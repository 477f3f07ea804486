"""W8A8's recipe: the seeded calibration prompts, the per-channel activation maxima at every
quantised GEMM's input, SmoothQuant's factors, the quantisation sites and which of them stay in
the model's precision (``HELD_SITES``).  ``refstack.model.quant`` applies it.

Calibration runs once at load time (``refstack.model.quant.quantize_model``) on seeded random
printable text through the byte tokenizer: nothing is downloaded, and the prompts are not the
quality probe's or the benchmark's evaluation prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from refstack.model.attention import AttentionLayer
from refstack.model.batch import SeqChunk
from refstack.model.kda import KDALayer
from refstack.model.layers import Linear
from refstack.model.moe import MoE, route
from refstack.model.tokenizer import ByteTokenizer

ALPHA = 0.5  # SmoothQuant's migration strength (docs/quantization.md: 0.3-0.85 measured the same here)
CALIBRATION_SEED = 20_251_201
# 16 prompts of 96 characters: 16 x (96 + BOS) = 1552 tokens.  More tokens make the per-channel
# maxima (hence the factors) less dependent on which few tokens the sample happened to hold;
# the load-time cost is one prefill of these through torch's path.
CALIBRATION_PROMPTS = 16
CALIBRATION_LEN = 96
S_MIN = 1e-5  # SmoothQuant's clamp of the factors (and of the maxima they are made of)

# The sites of one decoder layer that W8A8 quantises (or holds: HELD_SITES below).
SITES = ("mixer_in", "mixer_out", "experts")

# The sites W8A8 leaves in the model's precision (bf16 GEMMs on a CPU with a bf16 dot product,
# else fp32), by name ``"<layer>.<site>"`` (``SITES``).  Chosen on the calibration prompts, not
# on any evaluation set (``python bench/w8a8_sites.py`` on ``small``): quantised alone, each of
# these moves the logits at least 20% as much as quantising every site does (KL to the
# unquantised model).  They are the first layers' because an error there passes through every
# later router, where a near-tie flips a token to another expert, and through the KDA
# recurrence, which carries it along the sequence; the per-GEMM error is about the same at
# every layer (1-1.4% of the output's norm).  6 of 24 sites, 28% of the quantisable
# multiply-adds per token; docs/quantization.md has what they cost in speed and buy in quality.
HELD_SITES = ("0.mixer_in", "1.mixer_in", "0.experts", "2.mixer_in", "1.experts", "0.mixer_out")


def calibration_prompts(seed: int = CALIBRATION_SEED, n: int = CALIBRATION_PROMPTS,
                        length: int = CALIBRATION_LEN) -> list[list[int]]:
    """Seeded random printable text through the byte tokenizer (BOS first)."""
    rng = random.Random(seed)
    tok = ByteTokenizer()
    alphabet = [chr(c) for c in range(32, 127)]
    return [tok.encode("".join(rng.choice(alphabet) for _ in range(length)), add_bos=True) for _ in range(n)]


def site_names(num_layers: int) -> list[str]:
    """Every site of a model: ``"<layer>.<site>"`` (``SITES``), in layer order."""
    return [f"{i}.{s}" for i in range(num_layers) for s in SITES]


def mixer_linears(mixer: nn.Module) -> tuple[Linear, Linear]:
    """A mixer's input and output projections: attention's qkv_proj / o_proj, KDA's in_proj / o_proj."""
    if isinstance(mixer, AttentionLayer):
        return mixer.qkv_proj, mixer.o_proj
    assert isinstance(mixer, KDALayer)
    return mixer.in_proj, mixer.o_proj


@dataclass
class _Max:
    """A running per-channel max |x|."""

    value: Tensor | None = None

    def update(self, x: Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        self.value = m if self.value is None else torch.maximum(self.value, m)


@torch.inference_mode()
def calibrate(model: Any, prompts: list[list[int]]) -> dict[str, Tensor]:
    """Per-input-channel max |X| of every quantised GEMM's input on ``prompts`` (one prefill
    step on the model's current path): ``"<module>"`` for the Linears, ``"<moe>.x"`` for the
    experts' input and ``"<moe>.hidden"`` [E, I] for each expert's down-projection input."""
    stats: dict[str, _Max] = {}
    hidden: dict[str, Tensor] = {}
    hooks = []
    names = {id(m): n for n, m in model.named_modules()}

    def linear_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        stats.setdefault(names[id(module)], _Max()).update(args[0])

    def moe_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        assert isinstance(module, MoE)
        x = args[0].float()
        name = names[id(module)]
        stats.setdefault(name + ".x", _Max()).update(x)
        ids, _ = route(module.router(x), module.top_k)
        inner = module.w_gate_up.shape[2] // 2
        acc = hidden.setdefault(name, torch.zeros(module.num_experts, inner, device=x.device))
        for e in range(module.num_experts):
            rows = x[(ids == e).any(-1)]
            if rows.shape[0]:
                gu = rows @ module.w_gate_up[e]
                h = F.silu(gu[:, :inner]) * gu[:, inner:]
                acc[e] = torch.maximum(acc[e], h.abs().amax(0))

    for module in model.modules():
        if isinstance(module, (AttentionLayer, KDALayer)):
            for lin in mixer_linears(module):
                hooks.append(lin.register_forward_pre_hook(linear_hook))
        elif isinstance(module, MoE):
            hooks.append(module.register_forward_pre_hook(moe_hook))
    try:
        cache = model.new_cache(num_slots=len(prompts), max_seq_len=max(map(len, prompts)))
        model.forward_chunks([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], cache)
    finally:
        for h in hooks:
            h.remove()
    out = {k: v.value for k, v in stats.items() if v.value is not None}
    out.update({k + ".hidden": v for k, v in hidden.items()})
    return out


def smoothing_factors(x_max: Tensor, w_max: Tensor, alpha: float = ALPHA) -> Tensor:
    """SmoothQuant's s = max|X|^alpha / max|W|^(1 - alpha) per input channel; 1 where the
    calibration never saw the channel (no evidence to move range by)."""
    s = x_max.clamp(min=S_MIN).pow(alpha) / w_max.clamp(min=S_MIN).pow(1.0 - alpha)
    s = s.clamp(min=S_MIN)
    return torch.where(x_max > 0, s, torch.ones_like(s))


def resolve_held(num_layers: int, held: tuple[str, ...] | None) -> frozenset[str]:
    """``held`` (None: ``HELD_SITES``) as a set of this model's site names.  A default site past
    the model's layers is dropped (a shallower preset); a name given that is no site is an error."""
    sites = set(site_names(num_layers))
    if held is None:
        return frozenset(s for s in HELD_SITES if s in sites)
    unknown = sorted(set(held) - sites)
    if unknown:
        raise ValueError(f"w8a8 held sites {unknown} are not sites of this model (LAYER.SITE, SITE one of {SITES}, "
                         f"LAYER < {num_layers})")
    return frozenset(held)
