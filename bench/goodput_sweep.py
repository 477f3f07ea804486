"""Goodput search on refstack: the bisection's answer and cost against auto_tune's linear step.

    python bench/goodput_sweep.py [--grid max_running=1,4] [--step-delay-ms 30] [--e2el-ms 800]
                                  [--requests 8] [--out DIR]

Writes a workspace (refstack tiny, one scenario with a ``goodput:`` section: constant
arrivals, a p99 E2E latency limit) to a temporary folder and runs ``infra-agent goodput``'s
sweep on it.  The table prints, per configuration, the goodput found, its bracket, the
throughput the server reaches with every request at once (the search's ceiling, measured
in the same run) and goodput as a share of it; then the rates and windows the bisection
spent against the rates vLLM's auto_tune would step through from that throughput down
to the goodput, one request per second at a time, on the same configurations.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import yaml

from infra_agent.serving.goodput_run import grid_configs, run_sweep, write_sweep
from infra_agent.workspace import load_workspace


def _workspace(root: Path, step_delay_ms: float, e2el_ms: float, requests: int) -> Path:
    spec = {
        "name": "goodput-bench",
        "target": {"kind": "server", "command": [sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny",
                                                 "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning",
                                                 "--max-running", "{max_running}", "--step-delay-ms", "{step_delay_ms}"],
                   "ready_url": "/health", "metrics_url": "/metrics", "ready_timeout_s": 120},
        "knobs": {"max_running": {"type": "int", "min": 1, "max": 64, "default": 1, "components": ["engine.scheduler"]},
                  "step_delay_ms": {"type": "float", "min": 0, "max": 1000, "default": step_delay_ms,
                                    "components": ["engine.loop"]}},
        "scenarios": {"chat": {"dataset": {"kind": "random", "input_len": 16, "output_len": 8, "seed": 0},
                               "num_requests": requests, "burstiness": math.inf, "temperature": 1.0,
                               "goodput": {"slo": {"e2el_ms": e2el_ms}, "rate_min": 1, "tolerance": 0.15, "max_rates": 8}}},
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="max_running=1,4")
    ap.add_argument("--step-delay-ms", type=float, default=30.0)
    ap.add_argument("--e2el-ms", type=float, default=800.0)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    knob, _, values = args.grid.partition("=")
    with tempfile.TemporaryDirectory() as tmp:
        ws = load_workspace(_workspace(Path(tmp) / "ws", args.step_delay_ms, args.e2el_ms, args.requests))
        search = ws.scenario("chat").goodput
        assert search is not None
        t0 = time.monotonic()
        sweep = run_sweep(ws, "chat", grid_configs({}, {knob: values.split(",")}), search,
                          lambda s: print(s, file=sys.stderr, flush=True))
        wall = time.monotonic() - t0
        if args.out:
            write_sweep(sweep, args.out)
    print("| configuration | goodput req/s | bracket | max throughput req/s | goodput / max | rates | windows "
          "| auto_tune's rates (1 req/s steps) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sweep["configurations"]:
        if r.get("error"):
            print(f"| {r['label']} | error: {r['error'][:80]} |")
            continue
        lo, hi = r["bracket"]
        thr, gp = r.get("max_throughput_rps"), r.get("goodput_rps")
        # auto_tune starts at int(throughput)+1 and steps down one req/s until the limit holds.
        steps = int(thr) + 1 - (math.floor(gp) if gp else 0) + 1 if thr else None
        fmt = lambda x, f=".3g": "-" if x is None else format(x, f)  # noqa: E731
        print(f"| {r['label']} | {fmt(gp)} | [{fmt(lo)}, {fmt(hi)}] | {fmt(thr)} | {fmt(r.get('of_max_throughput'), '.0%')} "
              f"| {len(r['rates'])} | {r['windows']} | {fmt(steps, 'd')} |")
    print(f"\nwall time {wall:.0f} s for {len(sweep['configurations'])} configuration(s)")


if __name__ == "__main__":
    main()
