"""refstack engine output tokens/s against HF transformers ``generate``, batch 1 / 8 / 32.

    python bench/engine_throughput.py [--preset small] [--repeats 5] [--prompt-len 32] [--gen-len 64]
                                      [--long-prompt-len 512 --long-batches 8] [--dtype auto|float32|bfloat16]

"A Llama of equal width, depth and vocab" does not pin the Llama's MLP width, and
the choice decides the answer, so the run measures BOTH peers side by side, each a
randomly initialised ``LlamaForCausalLM`` with refstack's hidden size, depth, vocab
and attention shape (no download):

- ``HF-active``: dense MLP width ``num_experts_per_tok * expert_hidden_size``, the
  MoE's active width per token (FLOP-matched; far fewer weights);
- ``HF-total``: dense MLP width ``num_experts * expert_hidden_size``, all experts'
  width (MLP-parameter-matched: the weight bytes a batch that touches every expert
  reads per step).

``--dtype`` is refstack's GEMM operand type (``HybridConfig.dtype``); the default,
``auto``, is what ``refstack serve`` picks on this machine (bf16 where the native
kernels have a bf16 dot product, see ``refstack.engine.config.resolve_dtype``).  Both
peers run in the same dtype (``.to(torch.bfloat16)`` for bf16), so those ratios compare
one dtype; in a bf16 run a third peer, ``HF-active-fp32``, is HF-active in fp32 (HF's
default), so refstack is also compared with the peer at its other dtype.

Before timing, a correctness gate (``engine_gate.py``) checks on the bench's own prompts
that refstack's native kernels give the torch path's logits (same weights, same dtype)
and, for bf16, how close the bf16 model stays to the fp32 one; a failed gate stops the
run before any number is printed.

refstack runs twice, on the same weights: with its native CPU kernels (the engine's
default, ``cpu_kernels=auto``) and with torch's matmuls (``refstack-torch``), so the
kernels' share of the result is measured in the same run.

All stacks run greedy, fixed-length generation (EOS ignored) in the same process on
the same torch threads; throughput counts the prefill too (batch * gen_len / wall).
Runs are interleaved with the order rotated each repeat, so machine drift hits all
three; each ratio's 95% confidence interval is a paired bootstrap over the repeats.
``--long-prompt-len`` adds a separately labelled table with long prompts, where
refstack's KDA layers keep O(1) state while every Llama layer attends over the prompt.
Needs ``pip install transformers`` (the ``bench`` extra); tests never import this file.
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
from engine_gate import check_gate  # bench/ is the script's directory

from refstack.engine import Engine, EngineConfig, SamplingParams
from refstack.engine.config import resolve_dtype
from refstack.kernels import cpu_kernels
from refstack.model import ByteTokenizer, HybridConfig, HybridModel
from refstack.model.config import DTYPES

BATCHES = (1, 8, 32)


def hf_peer(cfg: HybridConfig, mlp: str, dtype: str) -> Any:
    """A randomly initialised Llama, in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # "active": the MLP width one token runs through (FLOP-matched);
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
    model = LlamaForCausalLM(hf_cfg).eval()
    return model.to(torch.bfloat16) if dtype == "bfloat16" else model


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


OURS = ("refstack", "refstack-torch")
# Column labels of the stacks refstack is compared with, in table order.
LABELS = {"hf-active": "HF-active", "hf-active-fp32": "HF-active-fp32", "hf-total": "HF-total",
          "refstack-torch": "refstack-torch"}


def make_peers(cfg: HybridConfig, dtype: str) -> dict[str, Any]:
    """The HF Llamas: FLOP-matched and weight-matched in refstack's dtype, and in a bf16 run
    the FLOP-matched one in fp32 too (HF's default dtype, and on this CPU its faster one
    in some runs)."""
    peers = {"hf-active": hf_peer(cfg, "active", dtype), "hf-total": hf_peer(cfg, "total", dtype)}
    if dtype == "bfloat16":
        peers["hf-active-fp32"] = hf_peer(cfg, "active", "float32")
    return peers


def make_engine(model: HybridModel, preset: str, batch: int, prompt_len: int, cpu_kernels: str = "auto") -> Engine:
    # Every prompt of the batch prefills whole in one step, as HF's generate does.
    return Engine(EngineConfig(preset=preset, max_running=batch, max_batch_tokens=batch * prompt_len,
                               prefill_chunk=prompt_len, cpu_kernels=cpu_kernels), model=model, tokenizer=ByteTokenizer())


def measure(engines: dict[str, Engine], peers: dict[str, Any], batches: list[int], prompt_len: int, gen_len: int,
            repeats: int, vocab: int, label: str) -> dict[int, dict[str, list[float]]]:
    stacks = [*engines, *peers]
    samples: dict[int, dict[str, list[float]]] = {b: {s: [] for s in stacks} for b in batches}
    for b in batches:  # warm-up: first-call allocations, lazy inits
        p = prompts(b, prompt_len, vocab, seed=b)
        for engine in engines.values():
            run_refstack(engine, p, 4)
        for m in peers.values():
            run_hf(m, p, 4)
    for r in range(repeats):
        for b in batches:
            p = prompts(b, prompt_len, vocab, seed=1000 * r + b)
            # Rotate the order each repeat so no stack always runs first (drift cancels).
            shift = r % len(stacks)
            for name in stacks[shift:] + stacks[:shift]:
                tps = run_refstack(engines[name], p, gen_len) if name in engines else run_hf(peers[name], p, gen_len)
                samples[b][name].append(tps)
                print(f"  {label} repeat {r + 1}/{repeats} batch {b:>2} {name:>14}: {tps:8.1f} tok/s",
                      file=sys.stderr, flush=True)  # progress; the tables go to stdout
    return samples


def print_table(samples: dict[int, dict[str, list[float]]]) -> None:
    others = [k for k in LABELS if k in next(iter(samples.values()))]
    head = "".join(f" | {LABELS[o]} tok/s | refstack / {LABELS[o]} [95% CI]" for o in others)
    print(f"| batch | refstack tok/s{head} |")
    print("|---|---" + "|---|---" * len(others) + "|")
    for b, s in samples.items():
        cells = [f"{statistics.median(s['refstack']):.1f}"]
        for other in others:
            point, lo, hi = ratio_ci(s["refstack"], s[other])
            cells += [f"{statistics.median(s[other]):.1f}", f"**{point:.2f}x** [{lo:.2f}, {hi:.2f}]"]
        print(f"| {b} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--long-prompt-len", type=int, default=0, help="also run a long-prompt table (0: skip)")
    ap.add_argument("--long-batches", type=int, nargs="+", default=[8])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                    help="refstack's GEMM operand type (auto: what refstack serve picks here); the HF peers run in it too")
    ap.add_argument("--json", dest="json_path", help="also write the raw samples here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = resolve_dtype(args.dtype, "auto")
    cfg = HybridConfig.preset(args.preset, dtype=dtype)
    ours = {name: HybridModel(cfg) for name in OURS}  # same seed, same weights; one per matmul path
    peers = make_peers(cfg, dtype)
    n_params = {k: sum(p.numel() for p in m.parameters()) / 1e6 for k, m in peers.items()}
    print(f"# preset={args.preset} hidden={cfg.hidden_size} layers={cfg.num_layers} vocab={cfg.vocab_size} "
          f"refstack params={ours['refstack'].num_parameters / 1e6:.1f}M (MoE {cfg.num_experts}x{cfg.expert_hidden_size}, "
          f"top-{cfg.num_experts_per_tok})")
    print(f"# HF-active: Llama MLP width {cfg.num_experts_per_tok * cfg.expert_hidden_size} (= top_k x expert_hidden, "
          f"FLOP-matched), {n_params['hf-active']:.1f}M params")
    print(f"# HF-total: Llama MLP width {cfg.num_experts * cfg.expert_hidden_size} (= num_experts x expert_hidden, "
          f"MLP-weight-matched), {n_params['hf-total']:.1f}M params")
    print(f"# dtype={dtype} (--dtype {args.dtype}): refstack's GEMM operands; the HF peers' weights and activations"
          + ("; HF-active-fp32 is HF-active in float32" if "hf-active-fp32" in peers else ""))
    print(f"# gen_len={args.gen_len} repeats={args.repeats} torch_threads={torch.get_num_threads()} "
          f"cpu={platform.processor() or platform.machine()}")

    reason = cpu_kernels.unavailable_reason()
    print(f"# refstack: native CPU kernels ({reason or 'built'}); refstack-torch: torch matmuls")

    def engines(batch: int, prompt_len: int) -> dict[str, Engine]:
        return {name: make_engine(ours[name], args.preset, batch, prompt_len, "auto" if name == "refstack" else "torch")
                for name in OURS}

    main_engines = engines(max(args.batches), args.prompt_len)
    gate_prompts = prompts(8, args.prompt_len, cfg.vocab_size, seed=999_999)  # not a timed run's seed
    for line in check_gate(ours["refstack"], ours["refstack-torch"], gate_prompts):
        print(f"# gate: {line}")
    results: dict[str, Any] = {}
    results["main"] = measure(main_engines, peers, args.batches, args.prompt_len, args.gen_len, args.repeats,
                              cfg.vocab_size, "main")
    print(f"\n## prompt_len={args.prompt_len}, gen_len={args.gen_len}\n")
    print_table(results["main"])
    if args.long_prompt_len:
        results["long"] = measure(engines(max(args.long_batches), args.long_prompt_len), peers, args.long_batches,
                                  args.long_prompt_len, args.gen_len, args.repeats, cfg.vocab_size, "long")
        print(f"\n## long prompt: prompt_len={args.long_prompt_len}, gen_len={args.gen_len} (reported separately)\n")
        print_table(results["long"])
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"args": vars(args), "dtype": dtype, "samples": results}, fh, indent=2)


if __name__ == "__main__":
    main()
