"""Which W8A8 sites move the model most: the ranking ``quant_recipe.HELD_SITES`` comes from.

    python bench/w8a8_sites.py [--preset small] [--json out.json]

Each site (``"<layer>.<site>"``: a mixer's input or output projection, or a layer's experts)
is quantised alone, every other site held, and the model's logits after every position of the
**calibration prompts** (``quant_recipe.calibration_prompts``, the recipe's own: not the
quality probe's or the benchmark's evaluation prompts) are compared with the unquantised
model's: KL(model || site quantised) and top-1 agreement.  Then every site together, for
scale.  The recipe holds the sites whose KL alone is at least ``--share`` of the whole's.
"""

from __future__ import annotations

import argparse
import json

import torch

from refstack.engine.config import resolve_dtype
from refstack.model import HybridConfig, HybridModel, SeqChunk
from refstack.model.quant import quantize_model
from refstack.model.quant_recipe import HELD_SITES, calibration_prompts, site_names


@torch.inference_mode()
def logits(model: HybridModel, prompts: list[list[int]]) -> torch.Tensor:
    cache = model.new_cache(num_slots=len(prompts), max_seq_len=max(map(len, prompts)))
    chunks = [SeqChunk(i, p, 0) for i, p in enumerate(prompts)]
    _, rows = model.forward_chunks_all_positions(chunks, cache, range(len(prompts)))
    return torch.cat([rows[i] for i in range(len(prompts))]).double()


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    lp, lq = ref.log_softmax(-1), ours.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    return kl, (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--share", type=float, default=0.2, help="hold a site whose KL alone is >= this share of the whole's")
    ap.add_argument("--json", dest="json_path")
    args = ap.parse_args(argv)
    cfg = HybridConfig.preset(args.preset, dtype=resolve_dtype("auto", "auto"))
    prompts = calibration_prompts()

    def quantised(held: tuple[str, ...]) -> torch.Tensor:
        model = HybridModel(cfg)
        model.use_native_kernels(True)
        quantize_model(model, prompts=prompts, held=held)
        return logits(model, prompts)

    base = HybridModel(cfg)
    base.use_native_kernels(True)
    ref = logits(base, prompts)
    sites = site_names(cfg.num_layers)
    whole = compare(quantised(()), ref)
    out = {"all": whole}
    for site in sites:
        out[site] = compare(quantised(tuple(s for s in sites if s != site)), ref)
    print(f"# preset {args.preset}, {ref.shape[0]} calibration positions; every site int8: KL {whole[0]:.2e}, "
          f"top-1 {whole[1]:.4f}")
    print("| site | KL alone | share of the whole's | top-1 alone | held by the recipe |")
    print("|---|---|---|---|---|")
    for site in sorted(sites, key=lambda s: -out[s][0]):
        kl, top1 = out[site]
        print(f"| {site} | {kl:.2e} | {kl / whole[0]:.0%} | {top1:.4f} | {'yes' if site in HELD_SITES else ''} |")
    chosen = [s for s in sites if out[s][0] >= args.share * whole[0]]
    print(f"\nsites at >= {args.share:.0%} of the whole's KL: {', '.join(chosen)}")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
