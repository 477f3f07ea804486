"""refstack decode throughput under tensor parallelism on the CPU, and what communication costs.

    python bench/engine_tp.py [--preset small] [--batch 8] [--prompt-len 32] [--gen-len 48] [--repeats 3]

Rows (all torch's kernels at float32, greedy, EOS ignored, the engine driven in this
process; a TP rank other than 0 is a process of its own, started by ``refstack.tp``):

- ``tp1 x1``: one rank, one torch thread;
- ``tp1 x2``: one rank, two torch threads (the same two cores, shared by threads);
- ``tp2 x1``: two ranks, one thread each (the two cores, shared by processes + gloo);
- ``tp2 x1 lm_head=tf32 / 3xtf32``: the same with the LM head's precision changed.

Per row: decode tokens/s (tokens of decode-only steps over those steps' wall time, median
over the repeats), the decode step's median time, and for TP rows rank 0's share of its
decode steps spent in ``tp.*`` spans (the step broadcast, the all-reduces, the logits
gather).  That share is communication *plus skew*: a collective on rank 0 also waits
for the slower rank to arrive.  ``lm_head`` is rank 0's local LM-head GEMM per step.
There is no speed goal on two cores: the table says what partitioning costs here.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import torch

from infra_agent import tracing
from refstack.engine import Engine, EngineConfig, SamplingParams
from refstack.tp.group import TPModel

ROWS: list[tuple[str, dict[str, Any]]] = [
    ("tp1 x1", {"tp": 1, "torch_threads": 1}),
    ("tp1 x2", {"tp": 1, "torch_threads": 2}),
    ("tp2 x1", {"tp": 2, "torch_threads": 1}),
    ("tp2 x1 lm_head=tf32", {"tp": 2, "torch_threads": 1, "lm_head_precision": "tf32"}),
    ("tp2 x1 lm_head=3xtf32", {"tp": 2, "torch_threads": 1, "lm_head_precision": "3xtf32"}),
]


def _spans(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e["name"] == name]


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["tid"] == inner["tid"] and outer["ts"] <= inner["ts"] <= outer["ts"] + outer["dur"]


def measure(knobs: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    config = EngineConfig(preset=args.preset, cpu_kernels="torch", dtype="float32", max_running=args.batch, **knobs)
    model = TPModel(config) if config.tp > 1 else None
    try:
        engine = Engine(config, model=model)
        prompts = [[(7 * i + j) % 250 + 1 for j in range(args.prompt_len)] for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
        engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        rates, steps, shares, heads = [], [], [], []
        for _ in range(args.repeats):
            tracing.reset()
            engine.generate(prompts, params)
            events = tracing.snapshot()["traceEvents"]
            decode = [s for s in _spans(events, "decode")]
            tokens = sum(s["args"]["batch"] for s in decode)
            wall = sum(s["dur"] for s in decode) / 1e6
            rates.append(tokens / wall)
            steps.append(statistics.median(s["dur"] for s in decode) / 1e3)
            comm = [e for e in events if e.get("ph") == "X" and e.get("cat") == "tp" and e["name"] != "tp.forward"]
            shares.append(sum(c["dur"] for c in comm if any(_inside(c, d) for d in decode)) / (wall * 1e6))
            heads.append(statistics.median(h["dur"] for h in _spans(events, "lm_head")
                                           if any(_inside(h, d) for d in decode)) / 1e3)
    finally:
        if model is not None:
            model.close()
    return {"tok_s": statistics.median(rates), "step_ms": statistics.median(steps),
            "comm_share": statistics.median(shares), "lm_head_ms": statistics.median(heads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tracing.enable()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.2f} at start; preset {args.preset}, batch {args.batch}, "
          f"prompt {args.prompt_len}, gen {args.gen_len}, {args.repeats} repeats")
    results = {}
    start = time.perf_counter()
    for name, knobs in ROWS:
        results[name] = measure(knobs, args)
    base = results["tp1 x1"]["tok_s"]
    print("| run | decode tok/s | vs tp1 x1 | decode step ms (median) | rank 0 in tp.* spans | lm_head ms |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        share = f"{100 * r['comm_share']:.0f}%" if name.startswith("tp2") else "-"
        print(f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | {r['step_ms']:.2f} | {share} | "
              f"{r['lm_head_ms']:.3f} |")
    print(f"# load {os.getloadavg()[0]:.2f} at end; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
