"""refstack decode tokens/s by KDA decode kernel (torch vs triton) at batch 1 / 8 / 32 / 128.

    python bench/refstack_decode.py [--device cuda|cpu|auto] [--preset small] [--batches 1 8 32 128]
                                    [--repeats 5] [--prompt-len 32] [--gen-len 64] [--dtype float32] [--json]

One engine per ``kda_decode_kernel`` value, each with its own copy of the same model
(same seed, so the same weights), on one device, both on torch's path
(``cpu_kernels=torch``: the Triton kernel plugs into it, and it is the path a GPU runs).
The engines are driven in process through ``Engine.step``.  A measurement queues a
batch of prompts and steps, untimed, until every request has its first token (the
prefill, one step: the whole batch fits the step's token budget), then times the
decode steps until all finish: decode tok/s = batch * (gen_len - 1) / time.  Each step
ends with the engine's one copy of the logits to the host, so the clock stops on
finished GPU work.  Repeats are interleaved, the order rotated each repeat, and each
ratio has a 95% paired-bootstrap interval (``engine_throughput.ratio_ci``).

Before timing, a correctness gate: teacher-forced logits of the triton engine's model
against the torch one's (``engine_gate.teacher_forced``; the same fp32 tolerance and
share of positions as the native-vs-torch gate there).  A failed gate stops the run.

On ``--device cpu`` only torch runs (Triton needs a GPU; under TRITON_INTERPRET=1 both
run, but the triton column then times Triton's interpreter).  ``--json`` prints the
samples, medians and ratios as JSON instead of the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from engine_gate import MIN_CLOSE, SAME_DTYPE_TOL, teacher_forced  # bench/ is the script's directory
from engine_throughput import ratio_ci

from refstack.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from refstack.engine.device import resolve_placement

BATCHES = (1, 8, 32, 128)
GATE_STEPS = 8  # teacher-forced decode steps of the correctness gate
KERNELS = ("torch", "triton")


def prompts(batch: int, length: int, salt: int) -> list[list[int]]:
    """Byte prompts, distinct per row and per repeat (no two requests share a context)."""
    return [[(31 * (row + 1) + 7 * i + 13 * salt) % 256 for i in range(length)] for row in range(batch)]


def make_engine(args: argparse.Namespace, kernel: str) -> Engine:
    most = max(args.batches)
    return Engine(EngineConfig(
        preset=args.preset, device=args.device, dtype=args.dtype, cpu_kernels="torch", kda_decode_kernel=kernel,
        max_running=most, max_waiting=most, max_batch_tokens=max(512, most * args.prompt_len),
        prefill_chunk=args.prompt_len, max_seq_len=args.prompt_len + max(args.gen_len, GATE_STEPS) + 1,
        seed=args.seed))


def decode_tps(engine: Engine, batch_prompts: list[list[int]], gen_len: int) -> float:
    """Decode tokens per second of one batch, prefill excluded (see the module docstring)."""
    tokens: dict[str, int] = {}
    finished: set[str] = set()

    def sink(out: RequestOutput) -> None:
        tokens[out.request_id] = out.completion_tokens
        if out.finished:
            finished.add(out.request_id)

    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for p in batch_prompts:
        engine.add_request(p, params, sink)
    while len(tokens) < len(batch_prompts):
        engine.step()
    t0 = time.perf_counter()
    while len(finished) < len(batch_prompts):
        engine.step()
    elapsed = time.perf_counter() - t0
    assert all(n == gen_len for n in tokens.values()), tokens
    return len(batch_prompts) * (gen_len - 1) / elapsed


def gate(engines: dict[str, Engine], prompt_len: int, dtype: str) -> str:
    """Teacher-forced logits of every kernel against torch's; raises SystemExit on a miss."""
    batch = prompts(8, prompt_len, salt=-1)
    reference, fed = teacher_forced(engines["torch"].model, batch, steps=GATE_STEPS)
    line = "torch only: no gate"
    for name, engine in engines.items():
        if name == "torch":
            continue
        ours, _ = teacher_forced(engine.model, batch, steps=GATE_STEPS, feed=fed)
        rel = (ours - reference).abs().amax(-1) / reference.abs().amax()
        close = (rel <= SAME_DTYPE_TOL[dtype]).float().mean().item()
        line = (f"{name} vs torch: |logit diff| / max |logit| <= {SAME_DTYPE_TOL[dtype]:.0e} at {close:.1%} of "
                f"{rel.numel()} positions (limit {MIN_CLOSE:.0%}; max {rel.max().item():.1e})")
        if not close >= MIN_CLOSE:
            raise SystemExit(f"correctness gate failed: {line}")
    return line


def measure(engines: dict[str, Engine], args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    names = list(engines)
    samples: dict[int, dict[str, list[float]]] = {b: {n: [] for n in names} for b in args.batches}
    for b in args.batches:  # warm-up: allocations, Triton's compile for each batch shape
        for engine in engines.values():
            decode_tps(engine, prompts(b, args.prompt_len, salt=-2), 4)
    for r in range(args.repeats):
        for b in args.batches:
            batch = prompts(b, args.prompt_len, salt=r)
            shift = r % len(names)  # rotate the order so drift hits every kernel alike
            for name in names[shift:] + names[:shift]:
                tps = decode_tps(engines[name], batch, args.gen_len)
                samples[b][name].append(tps)
                print(f"  repeat {r + 1}/{args.repeats} batch {b:>3} {name:>6}: {tps:10.1f} tok/s",
                      file=sys.stderr, flush=True)
    return samples


def summary(samples: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for b, s in samples.items():
        row: dict[str, Any] = {"median_tok_s": {n: statistics.median(v) for n, v in s.items()}, "samples": s}
        if "triton" in s:
            row["triton_over_torch"] = dict(zip(("point", "ci_low", "ci_high"), ratio_ci(s["triton"], s["torch"])))
        out[b] = row
    return out


def print_table(rows: dict[int, dict[str, Any]], names: list[str]) -> None:
    ratio = "triton" in names
    head = " | ".join(f"{n} tok/s" for n in names) + (" | triton / torch [95% CI]" if ratio else "")
    print(f"| batch | {head} |")
    print("|---" * (1 + len(names) + ratio) + "|")
    for b, row in rows.items():
        cells = [f"{row['median_tok_s'][n]:.1f}" for n in names]
        if ratio:
            r = row["triton_over_torch"]
            cells.append(f"**{r['point']:.2f}x** [{r['ci_low']:.2f}, {r['ci_high']:.2f}]")
        print(f"| {b} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args()
    assert args.gen_len >= 2, "--gen-len must leave at least one decode step"

    device = resolve_placement(EngineConfig(device=args.device)).device
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    names = list(KERNELS) if device == "cuda" or interpreting else ["torch"]
    if names == ["torch"]:
        print("triton skipped: it needs a CUDA device (TRITON_INTERPRET=1 would time the interpreter)", file=sys.stderr)
    engines = {name: make_engine(args, name) for name in names}
    where = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} torch threads"
    gate_line = gate(engines, args.prompt_len, args.dtype)
    print(f"refstack decode, preset {args.preset}, {args.dtype}, {where}; prompt {args.prompt_len}, "
          f"{args.gen_len} tokens; {gate_line}", file=sys.stderr, flush=True)
    rows = summary(measure(engines, args))
    if args.json:
        print(json.dumps({"device": device, "where": where, "preset": args.preset, "dtype": args.dtype,
                          "prompt_len": args.prompt_len, "gen_len": args.gen_len, "repeats": args.repeats,
                          "gate": gate_line, "batches": rows}, indent=2))
    else:
        print_table(rows, names)


if __name__ == "__main__":
    main()
