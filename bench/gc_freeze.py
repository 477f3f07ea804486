"""What Python's garbage collector costs a refstack server, with and without ``--gc-freeze``.

    python bench/gc_freeze.py [--preset small] [--turns 4] [--num-requests 160] [--concurrency 16] [--json out.json]

Two servers of the same preset and seed run side by side, ``--gc-freeze false`` (a full
collection walks every object alive since startup: the model's modules and tensors,
torch's and the web stack's imports) and ``--gc-freeze true`` (the default: all of that
is frozen once the engine is built, as vLLM and SGLang do after startup).  Both run
with ``--trace true``.  They take turns, the order alternating: per turn, the span buffer
is cleared, ``infra-agent bench`` sends ``--num-requests`` streamed completions
(``--concurrency`` at a time) and the window's trace is fetched.  Reported per setting,
over the turns: the collections by generation from the trace's ``gc`` spans (count,
total and longest ms), and from the client's inter-token latencies the median, p99,
p99.9 and max.  A collection stops every stream in flight once, so it shows in the
tail (p99.9, max) and not in the median; the ratio column is frozen / not frozen.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from infra_agent.target.server import ServerProcess
from infra_agent.workspace.models import ServerTargetSpec


def server_spec(preset: str) -> ServerTargetSpec:
    return ServerTargetSpec(
        kind="server",
        command=[sys.executable, "-m", "refstack.cli", "serve", "--preset", preset, "--port", "{port}", "--trace", "true",
                 "--gc-freeze", "{freeze}", "--torch-threads", "1", "--log-level", "error"],
        ready_url="/health", ready_timeout_s=180)


def window(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    urllib.request.urlopen(url + "/debug/trace?reset=true", timeout=60).read()
    subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "bench", url, "--num-requests", str(args.num_requests), "--max-concurrency",
                    str(args.concurrency), "--input-len", "64", "--output-len", "64", "--warmup-requests", "2",
                    "--seed", str(args.seed), "-o", str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trace = json.loads(urllib.request.urlopen(url + "/debug/trace", timeout=60).read())
    result = json.loads(out.read_text())
    result = result.get("result", result)
    gcs = [(int(e["args"].get("generation", -1)), e["dur"] / 1e3) for e in trace["traceEvents"] if e.get("name") == "gc"]
    itls = [g * 1e3 for r in result["itls"] for g in r]
    return {"gc": gcs, "itl_ms": itls, "output_throughput": result["output_throughput"]}


def summarise(turns: list[dict[str, Any]]) -> dict[str, Any]:
    itl = np.array([x for t in turns for x in t["itl_ms"]])
    gcs = [g for t in turns for g in t["gc"]]
    by_gen = {}
    for gen in sorted({g for g, _ in gcs}):
        durs = [d for g, d in gcs if g == gen]
        by_gen[gen] = {"count": len(durs), "total_ms": sum(durs), "longest_ms": max(durs)}
    return {"by_generation": by_gen, "gc_total_ms": sum(d for _, d in gcs), "gc_longest_ms": max((d for _, d in gcs), default=0.0),
            "itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99)),
            "itl_p999_ms": float(np.percentile(itl, 99.9)), "itl_max_ms": float(itl.max()),
            "output_throughput": float(np.mean([t["output_throughput"] for t in turns])), "itls": int(itl.size)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    settings = {"not frozen": "false", "frozen": "true"}
    turns: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="gc-freeze-") as tmp, ExitStack() as stack:
        servers = {name: stack.enter_context(ServerProcess(server_spec(args.preset), {"freeze": flag}, Path(tmp) / "logs",
                                                           name=f"refstack-gc-freeze-{flag}"))
                   for name, flag in settings.items()}
        for t in range(args.turns):
            for name in (list(settings) if t % 2 == 0 else list(settings)[::-1]):
                turns[name].append(window(servers[name].url, args, Path(tmp) / f"{name}-{t}.json"))
                print(f"  turn {t + 1}/{args.turns} {name}: {len(turns[name][-1]['gc'])} collections, longest "
                      f"{max((d for _, d in turns[name][-1]['gc']), default=0.0):.1f} ms", file=sys.stderr, flush=True)
    rows = {name: summarise(ts) for name, ts in turns.items()}
    print(f"# refstack {args.preset}, {args.turns} turns x {args.num_requests} requests ({args.concurrency} at a time, "
          f"64 in / 64 out), one torch thread per server; collections from the servers' gc spans")
    print("| setting | full collections: n, total / longest ms | young (gen 0-1): n, total ms | ITL p50 | p99 | p99.9 | max ms "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        full = r["by_generation"].get(2, {"count": 0, "total_ms": 0.0, "longest_ms": 0.0})
        young = [v for g, v in r["by_generation"].items() if g != 2]
        print(f"| {name} | {full['count']}, {full['total_ms']:.0f} / {full['longest_ms']:.0f} | {sum(v['count'] for v in young)}, "
              f"{sum(v['total_ms'] for v in young):.0f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['itl_p999_ms']:.1f} "
              f"| {r['itl_max_ms']:.1f} | {r['output_throughput']:.0f} |")
    f, n = rows["frozen"], rows["not frozen"]
    print(f"\nfrozen / not frozen: longest collection {f['gc_longest_ms'] / max(n['gc_longest_ms'], 1e-9):.3f}x, ITL p99.9 "
          f"{f['itl_p999_ms'] / n['itl_p999_ms']:.2f}x, max {f['itl_max_ms'] / n['itl_max_ms']:.2f}x, p50 "
          f"{f['itl_p50_ms'] / n['itl_p50_ms']:.2f}x, output tok/s {f['output_throughput'] / n['output_throughput']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps({"meta": vars(args) | {"json": str(args.json)}, "settings": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
