"""Where a refstack engine step's time goes, from the engine's own trace spans.

    python bench/engine_step_spans.py [--preset small] [--batch 32] [--prompt-len 32] [--gen-len 64]
                                      [--runs 4] [--cpu-kernels auto|native|torch] [--dtype auto|float32|bfloat16]
                                      [--trace out.json]

Runs ``Engine.generate`` on ``batch`` prompts ``runs`` times with tracing on (one
warm-up run first, not traced) and prints, for the ``decode`` and ``prefill`` spans,
the mean span and the mean time per step in each span nested inside it (``kda``,
``attention``, ``moe.*``, ``lm_head``), plus what no nested span covers.  Recording
spans costs a little: the step times here run slightly above an untraced run's.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
from typing import Any

# bench/ is the script's directory: the same engine set-up as bench/engine_throughput.py
from engine_throughput import make_engine

from infra_agent import tracing
from refstack.engine import SamplingParams
from refstack.engine.config import resolve_dtype
from refstack.model import HybridConfig, HybridModel
from refstack.model.config import DTYPES

PHASES = ("decode", "prefill")
OUTER = {"model.forward", *PHASES}


def breakdown(events: list[dict[str, Any]], phase: str) -> tuple[int, float, dict[str, float]]:
    """(number of ``phase`` spans, mean span us, {nested span name: mean us per phase span})."""
    spans = [e for e in events if e.get("ph") == "X"]
    outer = sorted((e["tid"], e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == phase)
    if not outer:
        return 0, 0.0, {}
    keys = [(tid, ts) for tid, ts, _ in outer]
    inside: dict[str, float] = collections.defaultdict(float)
    for e in spans:
        if e["name"] in OUTER:
            continue
        i = bisect.bisect_right(keys, (e["tid"], e["ts"])) - 1
        if i >= 0 and outer[i][0] == e["tid"] and e["ts"] + e["dur"] <= outer[i][2]:
            inside[e["name"]] += e["dur"]
    n = len(outer)
    return n, sum(end - ts for _, ts, end in outer) / n, {k: v / n for k, v in inside.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--cpu-kernels", default="auto", choices=["auto", "native", "torch"])
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                    help="the GEMMs' operand type (auto: what refstack serve picks here)")
    ap.add_argument("--trace", help="also write the Chrome trace here")
    args = ap.parse_args()

    model = HybridModel(HybridConfig.preset(args.preset, dtype=resolve_dtype(args.dtype, args.cpu_kernels)))
    engine = make_engine(model, args.preset, args.batch, args.prompt_len, args.cpu_kernels)
    prompts = [[(31 * b + 7 * i) % 256 for i in range(args.prompt_len)] for b in range(args.batch)]
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up, untraced
    tracing.enable()
    tracing.reset()
    for run in range(args.runs):
        engine.generate(prompts, params)
        print(f"  run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
    trace = tracing.snapshot()
    tracing.disable()
    if args.trace:
        with open(args.trace, "w") as fh:
            json.dump(trace, fh)
    print(f"# preset={args.preset} batch={args.batch} prompt_len={args.prompt_len} gen_len={args.gen_len} "
          f"runs={args.runs} native_kernels={engine.native_kernels} dtype={model.config.dtype}")
    print("| phase | spans | mean span ms | nested spans, ms per step | not in a nested span ms |")
    print("|---|---|---|---|---|")
    for phase in PHASES:
        n, mean_us, inside = breakdown(trace["traceEvents"], phase)
        if not n:
            continue
        parts = ", ".join(f"`{k}` {v / 1e3:.2f}" for k, v in sorted(inside.items(), key=lambda kv: -kv[1]))
        print(f"| {phase} | {n} | {mean_us / 1e3:.2f} | {parts} | {(mean_us - sum(inside.values())) / 1e3:.2f} |")


if __name__ == "__main__":
    main()
