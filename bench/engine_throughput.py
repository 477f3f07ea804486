"""refstack engine output tokens/s against HF transformers ``generate``, batch 1 / 8 / 32.

    python bench/engine_throughput.py [--preset small] [--repeats 5] [--prompt-len 32] [--gen-len 64]

The peer is a randomly initialised ``LlamaForCausalLM`` of equal width, depth, vocab and
attention shape (no download).  Its dense MLP has ``num_experts_per_tok *
expert_hidden_size`` intermediate units by default: the same active MLP width per token
as refstack's MoE (``--peer-mlp total`` matches all experts' weights instead).  Both run greedy, fixed-length generation (EOS ignored) in the same
process on the same torch threads; throughput counts the prefill too
(batch * gen_len / wall time).

Runs are interleaved (refstack, HF, HF, refstack, ...) so machine drift hits both; the
ratio's 95% confidence interval is a paired bootstrap over the repeats.  Needs
``pip install transformers`` (the ``bench`` extra); tests never import this file.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch

from refstack.engine import Engine, EngineConfig, SamplingParams
from refstack.model import ByteTokenizer, HybridConfig, HybridModel

BATCHES = (1, 8, 32)


def hf_peer(cfg: HybridConfig, mlp: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    # "active": the MLP width one token runs through (FLOP-matched, the default);
    # "total": all experts' width (weight-matched: the bytes a large batch reads).
    width = cfg.num_experts_per_tok if mlp == "active" else cfg.num_experts

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=width * cfg.expert_hidden_size,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(hf_cfg).eval()


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(batch)]


def run_refstack(engine: Engine, batch_prompts: list[list[int]], gen_len: int) -> float:
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(batch_prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == gen_len for o in outs)
    return len(batch_prompts) * gen_len / dt


@torch.inference_mode()
def run_hf(model: Any, batch_prompts: list[list[int]], gen_len: int) -> float:
    ids = torch.tensor(batch_prompts, dtype=torch.long)  # equal lengths: no padding needed
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                         min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape == (len(batch_prompts), ids.shape[1] + gen_len)
    return len(batch_prompts) * gen_len / dt


def ratio_ci(a: list[float], b: list[float], n_boot: int = 5000, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of means a/b and its 95% paired-bootstrap interval (pairs = interleaved repeats)."""
    rng = random.Random(seed)
    point = statistics.fmean(a) / statistics.fmean(b)
    idx = range(len(a))
    boots = []
    for _ in range(n_boot):
        pick = [rng.choice(idx) for _ in idx]
        boots.append(statistics.fmean(a[i] for i in pick) / statistics.fmean(b[i] for i in pick))
    boots.sort()
    return point, boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--peer-mlp", choices=("active", "total"), default="active",
                    help="HF MLP width: the MoE's active width per token, or all experts' width")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", dest="json_path", help="also write the raw samples here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = HybridConfig.preset(args.preset)
    ours = HybridModel(cfg)
    peer = hf_peer(cfg, args.peer_mlp)
    tok = ByteTokenizer()
    top = max(args.batches)
    engine = Engine(EngineConfig(preset=args.preset, max_running=top, max_batch_tokens=top * args.prompt_len,
                                 prefill_chunk=args.prompt_len), model=ours, tokenizer=tok)
    print(f"# preset={args.preset} hidden={cfg.hidden_size} layers={cfg.num_layers} vocab={cfg.vocab_size} "
          f"refstack params={ours.num_parameters / 1e6:.1f}M HF Llama params="
          f"{sum(p.numel() for p in peer.parameters()) / 1e6:.1f}M (MLP width: {args.peer_mlp})")
    print(f"# prompt_len={args.prompt_len} gen_len={args.gen_len} repeats={args.repeats} "
          f"torch_threads={torch.get_num_threads()} cpu={platform.processor() or platform.machine()}")

    samples: dict[int, dict[str, list[float]]] = {b: {"refstack": [], "hf": []} for b in args.batches}
    for b in args.batches:  # warm-up: first-call allocations, lazy inits
        p = prompts(b, args.prompt_len, cfg.vocab_size, seed=b)
        run_refstack(engine, p, 4)
        run_hf(peer, p, 4)
    for r in range(args.repeats):
        for b in args.batches:
            p = prompts(b, args.prompt_len, cfg.vocab_size, seed=1000 * r + b)
            order = ("refstack", "hf") if r % 2 == 0 else ("hf", "refstack")  # ABBA: drift cancels
            for name in order:
                fn = run_refstack if name == "refstack" else run_hf
                samples[b][name].append(fn(engine if name == "refstack" else peer, p, args.gen_len))
                print(f"  repeat {r + 1}/{args.repeats} batch {b:>2} {name:>8}: {samples[b][name][-1]:8.1f} tok/s",
                      file=sys.stderr, flush=True)  # progress; the table goes to stdout

    print()
    print("| batch | refstack tok/s (median) | HF generate tok/s (median) | ratio | 95% CI |")
    print("|---|---|---|---|---|")
    for b in args.batches:
        a, h = samples[b]["refstack"], samples[b]["hf"]
        point, lo, hi = ratio_ci(a, h)
        print(f"| {b} | {statistics.median(a):.1f} | {statistics.median(h):.1f} | {point:.2f}x | "
              f"[{lo:.2f}, {hi:.2f}] |")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"args": vars(args), "samples": samples}, fh, indent=2)


if __name__ == "__main__":
    main()
