"""Quantisation settings against the bf16 default: decode speed, KV bytes, batch that fits, quality.

    python bench/quantization.py [--preset small] [--repeats 8] [--batches 8 32] [--gen-len 64]
                                 [--budget-gib 1] [--context 2048] [--quick] [--json out.json]
    python bench/quantization.py --device cuda --batches 8 32 128     # the GPU table

On ``--device cuda`` the baseline is bf16 (``--dtype``; the GPU's serving default), W8A8
runs ``torch._int_mm`` (calibrated on the GPU), and the KV caches live on the GPU; the
same table, the same quality comparisons.

Settings (each an ``EngineConfig`` on the same seeded weights; see docs/quantization.md):

- ``bf16``: the launch default, ``--dtype auto`` (bf16 GEMMs where the native kernels have a
  bf16 dot product, fp32 elsewhere) with the fp32 KV cache (``kv_cache_dtype=auto``): the
  baseline of every ratio;
- ``w8a8``: ``--quantization w8a8`` (SmoothQuant-style int8 weights and activations; the
  recipe's sensitive sites, ``quant_recipe.HELD_SITES``, stay bf16);
- ``w8a8-all``: the same with every site int8 (``held=()``): what holding those sites costs
  in speed and buys in quality;
- ``kv-bf16``, ``kv-fp8``, ``kv-int8``: ``--kv-cache-dtype bf16 | fp8_e4m3 | int8``;
- ``kv-mixed``: ``--kv-cache-dtype int8 --kv-cache-dtype-layers FIRST:bf16`` (the first
  attention layer keeps bf16 K/V, the others int8).

Per setting:

- **decode tok/s** at each batch: the batch's prompts prefill in one step (not timed), then
  every decode step until each request has ``--gen-len`` tokens is timed; tok/s = batch x
  (gen_len - 1) / that time.  Repeats are interleaved with the setting order rotated each
  repeat (drift hits every setting alike); the median with a bootstrap 95% CI, and the ratio
  to ``bf16`` (ratio of means) with a paired bootstrap 95% CI over the repeats, as in
  ``bench/engine_throughput.py``;
- **the model's decode forward alone** at the largest batch (one token per sequence at the
  decode's middle position; no scheduling, sampling or Python between steps): interleaved
  repeats, the ratio to ``bf16`` with its paired CI.  The engine adds the same per-step work
  to every setting, so this ratio bounds the decode ratio above;
- **KV bytes per token** (K and V of every attention layer; the per-(layer, head) scales
  are a few floats per layer, not per token) and the **largest batch that fits** a fixed
  budget (``--budget-gib``) of sequences of ``--context`` tokens: counting the KV rows only,
  and counting the KV rows plus the sequence's KDA states (fixed per sequence);
- **quality** against ``bf16``: teacher-forced logits in-process on a fixed seeded prompt
  set (a prefill, then ``--quality-steps`` decode steps fed the baseline's greedy tokens,
  through each engine's own model and cache): KL(baseline || setting) of the next-token
  distributions, top-1 agreement (95% CI: bootstrap over prompts), and the relative logit
  error ||l - l_ref|| / ||l_ref|| per position at p50 / p90 / p99.  The KV settings are also
  compared with ``kv-bf16`` (the goal compares int8 / fp8 caches with a bf16 one).

A setting the engine cannot build yet (the KV storage knobs landed separately) prints
"not implemented" with the reason instead of numbers.  ``--quick`` is a smoke run (< 2 min).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from engine_throughput import ratio_ci  # bench/ is the script's directory

from refstack.engine import Engine, EngineConfig, SamplingParams
from refstack.engine.config import resolve_dtype
from refstack.kernels import cpu_kernels
from refstack.model import ByteTokenizer, HybridConfig, HybridModel, SeqChunk
from refstack.model.quant import quantize_model
from refstack.model.quant_ops import fused_gpu_kernel

GOAL_W8A8_SPEEDUP = 1.3  # at batch 32, vs bf16
GOAL_W8A8_TOP1 = 0.98
GOAL_KV_FIT = 1.9  # sequences in the same budget, int8 or fp8 vs bf16 KV
GOAL_KV_KL = 0.01  # vs the bf16 cache
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8_e4m3": 1, "int8": 1}


@dataclass
class Setting:
    name: str
    knobs: dict[str, Any]
    held: tuple[str, ...] | None = None  # W8A8's held sites (None: the recipe's)
    engines: dict[int, Engine] = field(default_factory=dict)
    error: str | None = None  # why it could not be built ("not implemented ...")


def settings_for(cfg: HybridConfig) -> list[Setting]:
    attn = cfg.full_attention_layers
    mixed = ",".join(f"{layer}:{'bf16' if i == 0 else 'int8'}" for i, layer in enumerate(attn))
    return [
        Setting("bf16", {}),
        Setting("w8a8", {"quantization": "w8a8"}),
        Setting("w8a8-all", {"quantization": "w8a8"}, held=()),
        Setting("kv-bf16", {"kv_cache_dtype": "bf16"}),
        Setting("kv-fp8", {"kv_cache_dtype": "fp8_e4m3"}),
        Setting("kv-int8", {"kv_cache_dtype": "int8"}),
        Setting("kv-mixed", {"kv_cache_dtype": "int8", "kv_cache_dtype_layers": mixed}),
    ]


def expected_kv_dtypes(cfg: HybridConfig, knobs: dict[str, Any]) -> dict[int, str]:
    """What each attention layer's K/V should be stored as under ``knobs`` (for the check
    that a setting really changed the cache, and the bytes when the cache cannot say)."""
    default = knobs.get("kv_cache_dtype", "auto")
    out = {layer: "fp32" if default == "auto" else default for layer in cfg.full_attention_layers}
    for item in filter(None, knobs.get("kv_cache_dtype_layers", "").split(",")):
        layer, dtype = item.split(":")
        out[int(layer)] = "fp32" if dtype == "auto" else dtype
    return out


def cache_kv_bytes_per_token(engine: Engine) -> int:
    """The engine's cache, K and V bytes per token over every attention layer."""
    cache = engine.cache
    footprint = getattr(cache, "footprint", None)
    if callable(footprint):
        return int(footprint()["kv_bytes_per_token"])
    keys, values = cache.keys, cache.values
    return sum(t[0, :, 0].numel() * t.element_size() for t in [*keys.values(), *values.values()])


def kda_state_bytes(engine: Engine) -> int:
    states = engine.cache.states
    return sum(t[0].numel() * t.element_size() for t in states.values())


def make_engine(model: HybridModel, preset: str, batch: int, prompt_len: int, max_seq_len: int,
                knobs: dict[str, Any], device: str = "cpu") -> Engine:
    # Every prompt of the batch prefills whole in one step (as in engine_throughput.py).
    cfg = EngineConfig(preset=preset, max_running=batch, max_batch_tokens=batch * prompt_len, prefill_chunk=prompt_len,
                       max_seq_len=max_seq_len, device=device, **knobs)
    return Engine(cfg, model=model, tokenizer=ByteTokenizer())


def build(settings: list[Setting], base: HybridModel, preset: str, batches: list[int],
          prompt_len: int, max_seq_len: int, device: str = "cpu") -> None:
    """Each setting's engines; a setting that cannot be built (or whose cache ignores the
    knob) is marked with why.  A W8A8 setting gets its own copy of the model (same seed, same
    weights), quantised here with its held sites before its engines see it."""
    for s in settings:
        model = base
        try:
            if s.knobs.get("quantization") == "w8a8":
                # Quantised where it runs: on cuda the calibration and the int8 layouts
                # are the GPU's (torch._int_mm), not the native CPU kernels'.
                model = HybridModel(base.config).to(device)
                quantize_model(model, held=s.held)
            for b in batches:
                s.engines[b] = make_engine(model, preset, b, prompt_len, max_seq_len, s.knobs, device)
        except (NotImplementedError, ValueError, TypeError, AssertionError, RuntimeError) as exc:
            s.error = f"not implemented ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            s.engines.clear()
            continue
        if "kv_cache_dtype" in s.knobs:
            want = sum(2 * base.config.num_kv_heads * base.config.head_dim * ELEMENT_BYTES[d]
                       for d in expected_kv_dtypes(base.config, s.knobs).values())
            got = cache_kv_bytes_per_token(next(iter(s.engines.values())))
            if got != want:
                s.error = f"not implemented (the cache stores {got} B/token, {want} expected)"
                s.engines.clear()


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(batch)]


def decode_tps(engine: Engine, batch_prompts: list[list[int]], gen_len: int) -> tuple[float, float]:
    """Decode tokens/s: the prefill step (and its first sampled token) untimed, then every
    decode step until each request has ``gen_len`` tokens.  Returns (wall: batch x steps /
    their total time, step: batch / the median step's time -- the same rate, but a step
    that another process's burst on this shared box stretched does not move it)."""
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    finished: list[int] = []
    for p in batch_prompts:
        engine.add_request(p, params, lambda out: finished.append(out.completion_tokens) if out.finished else None)
    engine.step()  # every prompt prefills in this step (max_batch_tokens = batch * prompt_len)
    times: list[float] = []
    while True:
        t0 = time.perf_counter()
        if not engine.step():
            break
        times.append(time.perf_counter() - t0)
    assert len(finished) == len(batch_prompts) and all(n == gen_len for n in finished), finished
    assert len(times) == gen_len - 1, f"{len(times)} decode steps for {gen_len} tokens: the prefill took more than one step"
    return len(batch_prompts) * len(times) / sum(times), len(batch_prompts) / statistics.median(times)


def measure(settings: list[Setting], batches: list[int], prompt_len: int, gen_len: int, repeats: int
            ) -> dict[str, dict[int, dict[str, list[float]]]]:
    """Samples by kind ("wall", "step"; see decode_tps), batch and setting."""
    live = [s for s in settings if s.error is None]
    samples: dict[str, dict[int, dict[str, list[float]]]] = {
        kind: {b: {s.name: [] for s in live} for b in batches} for kind in ("wall", "step")}
    for b in batches:  # warm-up: first-call allocations, lazy inits
        for s in live:
            decode_tps(s.engines[b], prompts(b, prompt_len, seed=b), 3)
    for r in range(repeats):
        for b in batches:
            p = prompts(b, prompt_len, seed=1000 * r + b)
            shift = r % len(live)
            for s in live[shift:] + live[:shift]:
                wall, step = decode_tps(s.engines[b], p, gen_len)
                samples["wall"][b][s.name].append(wall)
                samples["step"][b][s.name].append(step)
                print(f"  repeat {r + 1}/{repeats} batch {b:>2} {s.name:>8}: {wall:8.1f} decode tok/s "
                      f"({step:8.1f} by the median step)", file=sys.stderr, flush=True)
    return samples


@torch.inference_mode()
def measure_forward(settings: list[Setting], batch: int, position: int, repeats: int, calls: int = 20
                    ) -> dict[str, list[float]]:
    """The model's decode forward alone (one token for each of ``batch`` slots at ``position``:
    no scheduling, sampling, detokenisation or Python between steps), in us: the median of
    ``calls`` calls per repeat, repeats interleaved with the order rotated.  Its ratio to
    bf16 bounds what the engine's decode ratio can reach: the engine adds the same per-step
    work to both."""
    live = [s for s in settings if s.error is None and batch in s.engines]
    rng = random.Random(batch)
    chunks = [SeqChunk(slot, [rng.randrange(256)], position) for slot in range(batch)]
    out: dict[str, list[float]] = {s.name: [] for s in live}
    for s in live:  # warm-up
        s.engines[batch].model.forward_chunks(chunks, s.engines[batch].cache)
    for r in range(repeats):
        shift = r % len(live)
        for s in live[shift:] + live[:shift]:
            model, cache = s.engines[batch].model, s.engines[batch].cache
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                logits = model.forward_chunks(chunks, cache)
                if logits.is_cuda:  # the launches return before the GPU is done
                    torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            out[s.name].append(statistics.median(ts) * 1e6)
    return out


def median_ci(xs: list[float], n_boot: int = 5000, seed: int = 0) -> tuple[float, float, float]:
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n_boot))
    return statistics.median(xs), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


# ---------------------------------------------------------------- quality
@torch.inference_mode()
def teacher_forced(engine: Engine, qprompts: list[list[int]], steps: int, feed: list[list[int]] | None = None
                   ) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [steps + 1, prompts, vocab] through the engine's model AND cache (so its KV
    storage counts), the engine idle; the tokens fed (``feed``, or this run's greedy ones)."""
    model, cache = engine.model, engine.cache
    assert cache.num_slots >= len(qprompts), "the quality engine needs a slot per prompt"
    cache.reset()
    out = [model.forward_chunks([SeqChunk(i, p, 0) for i, p in enumerate(qprompts)], cache).float().cpu()]
    fed: list[list[int]] = []
    for s in range(steps):
        step = feed[s] if feed is not None else out[-1].argmax(-1).tolist()
        fed.append(step)
        chunks = [SeqChunk(i, [t], len(p) + s) for i, (p, t) in enumerate(zip(qprompts, step))]
        out.append(model.forward_chunks(chunks, cache).float().cpu())
    return torch.stack(out), fed


def quality(ours: torch.Tensor, ref: torch.Tensor, n_boot: int = 2000) -> dict[str, float]:
    """KL(ref || ours) per position (nats), top-1 agreement with a bootstrap CI over prompts,
    relative logit error ||ours - ref|| / ||ref|| per position at p50 / p90 / p99."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(ours.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)  # [steps + 1, prompts]
    agree = (ours.argmax(-1) == ref.argmax(-1)).double()
    rel = (ours.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    per_prompt = agree.mean(0).tolist()
    rng = random.Random(0)
    boots = sorted(statistics.fmean(rng.choices(per_prompt, k=len(per_prompt))) for _ in range(n_boot))
    q = torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)
    p50, p90, p99 = torch.quantile(rel.flatten(), q).tolist()
    return {"kl_mean": kl.mean().item(), "kl_p99": torch.quantile(kl.flatten(), 0.99).item(),
            "top1": agree.mean().item(), "top1_lo": boots[int(0.025 * n_boot)], "top1_hi": boots[int(0.975 * n_boot) - 1],
            "rel_p50": p50, "rel_p90": p90, "rel_p99": p99, "positions": agree.numel()}


# ---------------------------------------------------------------- report
def print_speed(samples: dict[str, dict[int, dict[str, list[float]]]]) -> None:
    print("| setting | batch | decode tok/s, median [95% CI] | / bf16 [95% CI] | by the median step: tok/s [95% CI] "
          "| / bf16 [95% CI] |")
    print("|---|---|---|---|---|---|")
    for b, per in samples["wall"].items():
        for name in per:
            cells = []
            for kind in ("wall", "step"):
                ys, base = samples[kind][b][name], samples[kind][b]["bf16"]
                med, lo, hi = median_ci(ys)
                ratio = "1.00x" if name == "bf16" else "**{:.2f}x** [{:.2f}, {:.2f}]".format(*ratio_ci(ys, base))
                cells += [f"{med:.1f} [{lo:.1f}, {hi:.1f}]", ratio]
            print(f"| {name} | {b} | " + " | ".join(cells) + " |")


def print_forward(forward: dict[str, list[float]], batch: int) -> None:
    print("| setting | batch | forward us, median [95% CI] | bf16 / setting [95% CI] |")
    print("|---|---|---|---|")
    for name, ys in forward.items():
        med, lo, hi = median_ci(ys)
        ratio = "1.00x" if name == "bf16" else "**{:.2f}x** [{:.2f}, {:.2f}]".format(*ratio_ci(forward["bf16"], ys))
        print(f"| {name} | {batch} | {med:.0f} [{lo:.0f}, {hi:.0f}] | {ratio} |")


def print_memory(settings: list[Setting], cfg: HybridConfig, budget: int, context: int) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for s in settings:
        if s.error is not None:
            continue
        engine = next(iter(s.engines.values()))
        kv, state = cache_kv_bytes_per_token(engine), kda_state_bytes(engine)
        rows[s.name] = {"kv_bytes_per_token": kv, "kda_state_bytes_per_seq": state,
                        "fit_kv_only": budget // (kv * context), "fit_with_state": budget // (kv * context + state)}
    ref = rows.get("kv-bf16")
    print(f"| setting | KV bytes/token | sequences of {context} tokens in {budget / 2**30:g} GiB, KV rows only | "
          f"x kv-bf16 | KV rows + KDA states ({next(iter(rows.values()))['kda_state_bytes_per_seq']} B/seq) | x kv-bf16 |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        x1 = f"{r['fit_kv_only'] / ref['fit_kv_only']:.2f}x" if ref else "-"
        x2 = f"{r['fit_with_state'] / ref['fit_with_state']:.2f}x" if ref else "-"
        print(f"| {name} | {r['kv_bytes_per_token']} | {r['fit_kv_only']} | {x1} | {r['fit_with_state']} | {x2} |")
    return rows


def print_quality(results: dict[str, dict[str, float]], against: str) -> None:
    print("| setting | vs | KL mean (nats) | KL p99 | top-1 agreement [95% CI] | rel. logit error p50 / p90 / p99 |")
    print("|---|---|---|---|---|---|")
    for name, q in results.items():
        print(f"| {name} | {against} | {q['kl_mean']:.2e} | {q['kl_p99']:.2e} | {q['top1']:.4f} "
              f"[{q['top1_lo']:.4f}, {q['top1_hi']:.4f}] | {q['rel_p50']:.2e} / {q['rel_p90']:.2e} / {q['rel_p99']:.2e} |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--quality-prompts", type=int, default=16)
    ap.add_argument("--quality-steps", type=int, default=32)
    ap.add_argument("--budget-gib", type=float, default=1.0)
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence for the batch that fits")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="auto", help="the model dtype (auto: the CPU launch default; bfloat16 on cuda)")
    ap.add_argument("--settings", nargs="+", help="a subset of the settings (bf16 is always run)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 repeats, short generations, fewer prompts")
    ap.add_argument("--json", dest="json_path", help="also write the raw samples and results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.gen_len = min(args.repeats, 2), min(args.gen_len, 16)
        args.quality_prompts, args.quality_steps = min(args.quality_prompts, 4), min(args.quality_steps, 8)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/quantization.py --device cuda: no CUDA device is visible")
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if args.device == "cuda" else resolve_dtype("auto", "auto")
    cfg = HybridConfig.preset(args.preset, dtype=dtype)
    max_seq_len = min(cfg.max_seq_len, args.prompt_len + max(args.gen_len, args.quality_steps) + 8)
    print(f"# preset={args.preset} dtype auto={dtype} batches={args.batches} prompt_len={args.prompt_len} "
          f"gen_len={args.gen_len} repeats={args.repeats} torch_threads={torch.get_num_threads()} "
          f"cpu={platform.processor() or platform.machine()}")
    if args.device == "cuda":
        fused = fused_gpu_kernel() is not None
        print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}; W8A8 on "
              + ("refstack.kernels.w8a8_triton (quantise, int8 GEMM and dequantise in one launch)" if fused
                 else "torch._int_mm (Triton is not installed)"))
    else:
        print(f"# native kernels: {cpu_kernels.unavailable_reason() or 'built'}; int8 tiles on "
              f"{'AVX512-VNNI vpdpbusd' if cpu_kernels.int8_dot_native() else 'the portable path'}; "
              f"bf16 dot product: {cpu_kernels.bf16_dot_native()}")
    settings = settings_for(cfg)
    if args.settings:
        settings = [s for s in settings if s.name == "bf16" or s.name in args.settings]
    base = HybridModel(cfg)
    qprompts = prompts(args.quality_prompts, args.prompt_len, seed=424_242)  # not a timed run's seed
    # The quality engines hold a slot per quality prompt; built before the timing ones.
    qbatch = max(args.quality_prompts, *args.batches)
    t0 = time.perf_counter()
    build(settings, base, args.preset, sorted({*args.batches, qbatch}), args.prompt_len, max_seq_len, args.device)
    print(f"# engines built in {time.perf_counter() - t0:.1f} s (w8a8: calibration and quantisation included)")
    for s in settings:
        if s.error:
            print(f"# {s.name}: {s.error}")

    # Quality first (a gate of sorts: a broken setting shows here before any time is spent).
    ref_logits, fed = teacher_forced(settings[0].engines[qbatch], qprompts, args.quality_steps)
    logits = {s.name: teacher_forced(s.engines[qbatch], qprompts, args.quality_steps, fed)[0]
              for s in settings[1:] if s.error is None}
    vs_base = {name: quality(lg, ref_logits) for name, lg in logits.items()}
    vs_kv_bf16 = {name: quality(lg, logits["kv-bf16"]) for name, lg in logits.items()
                  if name.startswith("kv-") and name != "kv-bf16" and "kv-bf16" in logits}

    samples = measure(settings, args.batches, args.prompt_len, args.gen_len, args.repeats)
    big = max(args.batches)
    # at the decode's middle position: attention reads as many cached rows as an average decode step
    forward = measure_forward(settings, big, args.prompt_len + args.gen_len // 2, args.repeats)
    budget = int(args.budget_gib * 2**30)
    print(f"\n## decode throughput (prompt {args.prompt_len}, {args.gen_len} tokens, {args.repeats} interleaved repeats)\n")
    print_speed(samples)
    print(f"\n## the model's decode forward alone at batch {big} (no engine: the bound on the ratios above; "
          f"{args.repeats} interleaved repeats of 20 calls)\n")
    print_forward(forward, big)
    print("\n## KV cache bytes and the largest batch that fits\n")
    memory = print_memory(settings, cfg, budget, args.context)
    print(f"\n## quality vs bf16 (teacher-forced, {args.quality_prompts} prompts x (prefill + {args.quality_steps} "
          f"decode steps) = {ref_logits.shape[0] * ref_logits.shape[1]} positions)\n")
    print_quality(vs_base, "bf16")
    if vs_kv_bf16:
        print("\n## KV storage vs the bf16 KV cache\n")
        print_quality(vs_kv_bf16, "kv-bf16")
    for s in settings:
        if s.error:
            print(f"\n{s.name}: {s.error}")

    print("\n## goals\n")
    if "w8a8" in vs_base and "w8a8" in samples["wall"][big]:
        point, lo, hi = ratio_ci(samples["wall"][big]["w8a8"], samples["wall"][big]["bf16"])
        spoint, slo, shi = ratio_ci(samples["step"][big]["w8a8"], samples["step"][big]["bf16"])
        top1 = vs_base["w8a8"]["top1"]
        met = point >= GOAL_W8A8_SPEEDUP and top1 >= GOAL_W8A8_TOP1
        print(f"- W8A8 >= {GOAL_W8A8_SPEEDUP}x bf16 decode at batch {big} with top-1 >= {GOAL_W8A8_TOP1}: "
              f"{'met' if met else 'NOT met'}: {point:.2f}x [{lo:.2f}, {hi:.2f}] (by the median step {spoint:.2f}x "
              f"[{slo:.2f}, {shi:.2f}]), top-1 {top1:.4f} [{vs_base['w8a8']['top1_lo']:.4f}, "
              f"{vs_base['w8a8']['top1_hi']:.4f}]; the model's forward alone "
              "{:.2f}x [{:.2f}, {:.2f}]".format(*ratio_ci(forward["bf16"], forward["w8a8"])))
    for name in ("kv-int8", "kv-fp8"):
        if name in memory and "kv-bf16" in memory and name in vs_kv_bf16:
            fit = memory[name]["fit_kv_only"] / memory["kv-bf16"]["fit_kv_only"]
            kl = vs_kv_bf16[name]["kl_mean"]
            met = fit >= GOAL_KV_FIT and kl <= GOAL_KV_KL
            print(f"- {name} fits >= {GOAL_KV_FIT}x the sequences of kv-bf16 with KL <= {GOAL_KV_KL}: "
                  f"{'met' if met else 'NOT met'}: {fit:.2f}x (KV rows only; "
                  f"{memory[name]['fit_with_state'] / memory['kv-bf16']['fit_with_state']:.2f}x with KDA states), "
                  f"KL {kl:.2e}")
        else:
            print(f"- {name}: not measured ({next((s.error for s in settings if s.name == name), 'not selected')})")
    results = {"args": vars(args), "dtype": dtype, "samples": samples, "forward_us": forward, "memory": memory,
               "quality_vs_bf16": vs_base,
               "quality_vs_kv_bf16": vs_kv_bf16, "errors": {s.name: s.error for s in settings if s.error}}
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump(results, fh, indent=2)
    return results


if __name__ == "__main__":
    main()
