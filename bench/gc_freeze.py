"""What Python's garbage collector costs refstack's decode steps, with and without ``--gc-freeze``.

    python bench/gc_freeze.py [--preset small] [--batch 32] [--gen-len 64] [--repeats 12] [--json out.json]

Two worker processes build the same engine (same seed, one torch thread), one with
``gc_freeze=False`` (the collector walks the whole heap on a full collection) and one
with ``gc_freeze=True`` (the default: everything alive after the engine is built is
frozen, as vLLM and SGLang do after startup).  They take turns, one ``generate`` of
``--batch`` prompts each per turn, the order alternating, so drift hits both alike.
Per decode step the workers record its wall time; per collection its generation and
duration (``gc.callbacks``).  Reported per setting: median, p99 and max step time, the
collections by generation with their total and longest time, and decode tok/s; the
ratios are frozen / not frozen, with the tok/s ratio's bootstrap 95% CI over the turns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def worker(args: argparse.Namespace) -> None:
    import gc
    import random

    from refstack.engine import Engine, EngineConfig, SamplingParams
    from refstack.model import ByteTokenizer

    engine = Engine(EngineConfig(preset=args.preset, max_running=args.batch, max_batch_tokens=args.batch * 32,
                                 prefill_chunk=32, torch_threads=1, gc_freeze=args.freeze),
                    tokenizer=ByteTokenizer())
    pauses: list[tuple[int, float]] = []
    t0 = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            pauses.append((int(info["generation"]), time.perf_counter() - t0[0]))

    gc.callbacks.append(on_gc)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for line in sys.stdin:  # one line per turn
        prompts = [[rng.randrange(256) for _ in range(32)] for _ in range(args.batch)]
        done: list[int] = []
        for p in prompts:
            engine.add_request(p, params, lambda out: done.append(1) if out.finished else None)
        pauses.clear()
        engine.step()  # the prefill, not timed
        steps = []
        while True:
            s = time.perf_counter()
            if not engine.step():
                break
            steps.append(time.perf_counter() - s)
        print(json.dumps({"steps": steps, "pauses": list(pauses), "frozen": gc.get_freeze_count()}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--freeze", type=lambda v: v == "true", default=True, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", "--preset", args.preset, "--batch", str(args.batch),
            "--gen-len", str(args.gen_len)]
    procs = {name: subprocess.Popen([*base, "--freeze", flag], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for name, flag in (("not frozen", "false"), ("frozen", "true"))}
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in procs}
    try:
        for r in range(args.repeats + 1):  # the first turn warms up, not counted
            for name in (list(procs) if r % 2 == 0 else list(procs)[::-1]):
                p = procs[name]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write("go\n")
                p.stdin.flush()
                line = p.stdout.readline()
                if not line:
                    raise SystemExit(f"the {name} worker exited ({p.wait()})")
                if r:
                    runs[name].append(json.loads(line))
                print(f"  turn {r}/{args.repeats} {name}", file=sys.stderr, flush=True)
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
            p.wait(30)
    rows = {name: summarise(rs, args.batch) for name, rs in runs.items()}
    a, b = runs["not frozen"], runs["frozen"]
    ratios = np.array([tps(y, args.batch) / tps(x, args.batch) for x, y in zip(a, b)])
    boot = np.random.default_rng(0).choice(ratios, (5000, len(ratios))).mean(axis=1)
    out = {"meta": {"preset": args.preset, "batch": args.batch, "gen_len": args.gen_len, "repeats": args.repeats,
                    "command": "python bench/gc_freeze.py " + " ".join(sys.argv[1:])},
           "settings": rows, "tok_s_ratio": {"mean": float(ratios.mean()), "ci": [float(np.percentile(boot, 2.5)),
                                                                              float(np.percentile(boot, 97.5))]}}
    print(f"# refstack {args.preset}, batch {args.batch}, {args.gen_len} tokens, {args.repeats} turns each, one torch thread")
    print("| setting | objects frozen | step p50 ms | step p99 ms | step max ms | full collections (total / longest ms) "
          "| young collections (total ms) | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['frozen']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} | {r['full']} "
              f"({r['full_ms']:.0f} / {r['full_longest_ms']:.0f}) | {r['young']} ({r['young_ms']:.1f}) | {r['tok_s']:.0f} |")
    f, n = rows["frozen"], rows["not frozen"]
    print(f"\nfrozen / not frozen: step p99 {f['p99_ms'] / n['p99_ms']:.2f}x, step max {f['max_ms'] / n['max_ms']:.2f}x, "
          f"decode tok/s {out['tok_s_ratio']['mean']:.3f}x [{out['tok_s_ratio']['ci'][0]:.3f}, {out['tok_s_ratio']['ci'][1]:.3f}]")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


def tps(run: dict[str, Any], batch: int) -> float:
    return batch * len(run["steps"]) / sum(run["steps"])


def summarise(runs: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    steps = np.array([s for r in runs for s in r["steps"]]) * 1e3
    pauses = [p for r in runs for p in r["pauses"]]
    full = [d for g, d in pauses if g == 2]
    young = [d for g, d in pauses if g != 2]
    return {"frozen": runs[-1]["frozen"], "p50_ms": float(np.percentile(steps, 50)), "p99_ms": float(np.percentile(steps, 99)),
            "max_ms": float(steps.max()), "full": len(full), "full_ms": 1e3 * sum(full),
            "full_longest_ms": 1e3 * max(full, default=0.0), "young": len(young), "young_ms": 1e3 * sum(young),
            "tok_s": float(np.mean([tps(r, batch) for r in runs]))}


if __name__ == "__main__":
    sys.exit(main())
