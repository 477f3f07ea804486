"""How well the judge separates A from B on this (noisy, shared, 2-core) machine.

    python bench/ab_power.py [--trials 10] [--pairs 50] [--requests 16] [--slowdown 0.05]  # B runs refstack --step-slowdown 0.05

Three refstack servers run side by side: A and A2 with default knobs, and B with
``--step-slowdown s``, refstack's documented calibration knob that makes every engine
step a fraction s longer (a busy-wait proportional to the step's own time, so the
change stays the stated size on any machine).  B's realised slowdown is measured
first on interleaved runs and reported with its interval.  Each trial then runs
``pairs`` cycles of A, A2, B (rotated each cycle so no side always goes first) and asks
the judge two questions on output throughput, from the paired per-run values:

- A/A (A vs A2): does the 95% interval of the ratio exclude 1?  That is a false positive.
- A/B (A vs B): does the interval lie wholly below 1?  That is a detection (power).

It prints one table: false-positive rate and power with Wilson 95% intervals over the
trials, the wall time of one comparison (the runs of its two sides), the calibrated
slowdown, and the minimum detectable effect at that budget computed from the paired
noise the A/A runs showed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from scipy import stats

from infra_agent.bench.runner import run_benchmark
from infra_agent.judge.bootstrap import bootstrap_ratio
from infra_agent.target import ServerProcess
from infra_agent.workspace.models import Scenario, ServerTargetSpec

SPEC = ServerTargetSpec(
    kind="server",
    command=[sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny", "--port", "{port}", "--step-slowdown", "{slowdown}",
             "--torch-threads", "{threads}"],
    ready_url="/health",
    metrics_url="/metrics",
    ready_timeout_s=180,
)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def one_run(server: ServerProcess, sc: Scenario) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = run_benchmark(server.url, sc, metrics_url=server.metrics_url, progress=False)
    res["wall_s"] = time.perf_counter() - t0
    return res


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    keep = [i for i in range(min(len(a), len(b))) if a[i]["failed"] == 0 and b[i]["failed"] == 0]
    return [a[i]["output_throughput"] for i in keep], [b[i]["output_throughput"] for i in keep]


def cycle(servers: dict[str, ServerProcess], sides: list[str], sc: Scenario, pairs: int) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for i in range(pairs):
        k = i % len(sides)
        for s in sides[k:] + sides[:k]:  # rotate who goes first
            runs[s].append(one_run(servers[s], sc))
    return runs


def calibrate(servers: dict[str, ServerProcess], sc: Scenario, pairs: int) -> Any:
    """Measure B's realised slowdown against A on interleaved pairs (reported, not tuned)."""
    cal = cycle(servers, ["A", "B"], sc, pairs)
    ca, cb = paired(cal["A"], cal["B"])
    return bootstrap_ratio(cb, ca, stat="mean", paired=True, seed=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="comparisons of each kind (A/A and A/B)")
    ap.add_argument("--pairs", type=int, default=50, help="interleaved runs per side in one comparison")
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slowdown", type=float, default=0.05, help="the true change B carries")
    ap.add_argument("--calibration-pairs", type=int, default=20)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="engine threads per server; 1 keeps three servers from oversubscribing 2 cores")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/ab_power_logs"))
    args = ap.parse_args()

    sc = Scenario.model_validate({
        "dataset": {"kind": "random", "input_len": args.input_len, "output_len": args.output_len, "seed": 1},
        "num_requests": args.requests, "max_concurrency": args.concurrency, "temperature": 1.0,
    })
    with ExitStack() as stack:
        servers = {name: stack.enter_context(ServerProcess(SPEC, {"slowdown": slow, "threads": args.torch_threads}, args.log_dir, name=name))
                   for name, slow in (("A", 0.0), ("A2", 0.0), ("B", args.slowdown))}
        for s in servers.values():  # warm every server (first requests pay one-off costs)
            one_run(s, sc)
        cal_ci = calibrate(servers, sc, args.calibration_pairs)

        fp = det = 0
        aa_logs: list[float] = []
        ab_logs: list[float] = []
        walls: list[float] = []
        for t in range(args.trials):
            runs = cycle(servers, ["A", "A2", "B"], sc, args.pairs)
            a, a2 = paired(runs["A"], runs["A2"])
            ci_aa = bootstrap_ratio(a2, a, stat="mean", paired=True, seed=100 + t)
            a, b = paired(runs["A"], runs["B"])
            ci_ab = bootstrap_ratio(b, a, stat="mean", paired=True, seed=200 + t)
            fp += not (ci_aa.low <= 1.0 <= ci_aa.high)
            det += ci_ab.high < 1.0
            aa_logs += [math.log(y / x) for x, y in zip(*paired(runs["A"], runs["A2"]))]
            ab_logs += [math.log(y / x) for x, y in zip(*paired(runs["A"], runs["B"]))]
            walls.append(sum(r["wall_s"] for r in runs["A"] + runs["B"]))
            print(f"trial {t}: A/A {ci_aa.ratio:.3f} [{ci_aa.low:.3f},{ci_aa.high:.3f}]  "
                  f"A/B {ci_ab.ratio:.3f} [{ci_ab.low:.3f},{ci_ab.high:.3f}]  A/B runs {walls[-1]:.0f}s", file=sys.stderr)

    n = args.pairs
    sd = statistics.stdev(aa_logs) if len(aa_logs) > 1 else float("nan")
    # Paired design, n pairs, two-sided 95%, 90% power: MDE = (t_.975 + t_.90)·sd/√n.
    mde = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.90, n - 1)) * sd / math.sqrt(n)
    # Power a paired t-style test of this size would have against a true 5% change.
    nc = -math.log(1 - 0.05) / (sd / math.sqrt(n))
    power_5 = 1 - stats.nct.cdf(stats.t.ppf(0.975, n - 1), n - 1, nc)
    fpr_ci, pow_ci = wilson(fp, args.trials), wilson(det, args.trials)
    true_drop = 1 - math.exp(statistics.mean(ab_logs)) if ab_logs else float("nan")
    rows = [
        ("trials (each kind)", f"{args.trials}", ""),
        ("pairs per comparison x requests per run", f"{n} x {args.requests}", ""),
        ("step slowdown for B", f"{args.slowdown:g}", "refstack --step-slowdown"),
        ("B slowdown, calibration", f"{1 - cal_ci.ratio:.1%}", f"95% CI [{1 - cal_ci.high:.1%}, {1 - cal_ci.low:.1%}], {args.calibration_pairs} pairs"),
        ("B slowdown, pooled over trials", f"{true_drop:.1%}", f"{len(ab_logs)} pairs"),
        ("false-positive rate (A/A)", f"{fp}/{args.trials} = {fp / args.trials:.0%}", f"Wilson 95% [{fpr_ci[0]:.0%}, {fpr_ci[1]:.0%}]; goal <= 5%"),
        ("power (A/B)", f"{det}/{args.trials} = {det / args.trials:.0%}", f"Wilson 95% [{pow_ci[0]:.0%}, {pow_ci[1]:.0%}]; goal >= 90%"),
        ("wall time per comparison [s]", f"{statistics.median(walls):.0f}", f"max {max(walls):.0f}; goal <= 120"),
        ("paired run-to-run noise (sd of log ratio)", f"{sd:.1%}", "from the A/A pairs"),
        ("power against a true 5% change (from that noise)", f"{power_5:.0%}", "noncentral t, same pairs"),
        ("min detectable effect at this budget", f"{mde:.1%}", "90% power, 95% two-sided; ratio to the 5% goal: " + f"{mde / 0.05:.2f}x"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"| {'quantity'.ljust(w)} | value | note |\n|{'-' * (w + 2)}|---|---|")
    for name, value, note in rows:
        print(f"| {name.ljust(w)} | {value} | {note} |")


if __name__ == "__main__":
    main()
