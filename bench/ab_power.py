"""How well the judge separates A from B on this (noisy, shared, 2-core) machine.

    python bench/ab_power.py [--trials 10] [--pairs 110] [--requests 16] [--slowdown 0.05]
                             [--restarts 1] [--process-noise 0.0]
                             [--server-cpus 0 --client-cpus 1] [--raw runs.json]

Every trial starts three fresh refstack servers: A and A2 with default knobs, and B
with ``--step-slowdown s``, refstack's documented calibration knob that stretches every
engine step period so that steps per second drop by s (a busy-wait proportional to the
previous period).  Each trial runs ``pairs`` cycles of A, A2, B (rotated each cycle so
no side always goes first) and asks the judge three questions on output throughput, from
the paired per-run values:

- A/A (A vs A2): does the 95% interval of the ratio exclude 1?  That is a false positive.
- A/B (A vs B): does the interval lie wholly below 1?  That is a detection (power).
- The same for an exactly 5% slower side with real noise: A2's runs scaled by 0.95
  (B's realised drop is what the knob does to the whole serving path, which is not
  exactly 5%; this row measures power at exactly 5%).

It prints one table: false-positive rate and power with Wilson 95% intervals over the
trials; the false-positive rate of comparisons redrawn from all A/A pairs (does the
interval hold its 95% on this noise?); B's realised throughput drop pooled over all
trials, with its interval (the knob acts on engine steps, the client sees the whole
serving path); the wall time of one comparison (starting, warming and stopping its
two servers, plus their runs); and the minimum detectable effect at that budget from the paired noise.

``--restarts R`` runs each trial as the judge's restarts do: R blocks of pairs/R cycles,
each block on three freshly started servers, and ``--process-noise`` is the spread
between two fresh processes that the judge's interval adds over those restarts
(``bootstrap_ratio(process_noise=...)``).  The table reports that spread as estimated
from this run's A/A blocks (one-way random-effects ANOVA), so one run calibrates
the next.  ``--process-noise loo`` does both in one run without judging a trial by
its own data: trial t's interval uses the spread estimated from the other trials.

``--server-cpus``/``--client-cpus`` pin the three servers and this process (the client)
to separate cores, so the client's event loop and the server under test never queue for
the same core; ``--raw`` keeps every run's throughput, duration and wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from infra_agent.serving.interleave import restart_blocks
from infra_agent.serving.runner import run_benchmark
from infra_agent.stats.bootstrap import bootstrap_ratio
from infra_agent.stats.process_noise import between_process_spread
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


def process_noise_estimate(blocks: list[list[float]]) -> tuple[float, float, tuple[int, int], float]:
    """tau (sd of the A/A log ratio between two fresh processes), F, its df and p-value:
    the one-way random-effects ANOVA the loop's calibration uses (stats/process_noise.py)."""
    spread = between_process_spread([b for b in blocks if len(b) >= 1])
    return spread.tau, spread.f, spread.df, spread.p


# Start orders of the three servers, one per restart in turn.  Over four restarts A
# starts before A2 twice and after it twice, and likewise before and after B.  With A
# always first, A2 ran 0.69% faster than A over 1700 pairs (2.5 standard errors): the
# order in which processes start is itself an offset, so it must not favour a side.
START_ORDERS = (("A", "A2", "B"), ("B", "A2", "A"), ("A2", "A", "B"), ("B", "A", "A2"))


def start_servers(stack: ExitStack, spec: ServerTargetSpec, args: argparse.Namespace, sc: Scenario,
                  order: tuple[str, ...], stopped: dict[str, float]) -> tuple[dict[str, ServerProcess], dict[str, float]]:
    """Fresh A, A2 and B for one block, each warmed by one run; seconds each took to be usable.

    Leaving ``stack`` stops them and adds each one's stopping time to ``stopped``.

    Fresh per block because a comparison in practice starts its own servers, and
    because per-process effects (memory layout, where the threads land) would
    otherwise repeat in every trial and make the trials' verdicts correlated."""
    servers, ready = {}, {}
    slowdown = {"A": 0.0, "A2": 0.0, "B": args.slowdown}
    for name in order:
        slow = slowdown[name]
        t0 = time.perf_counter()
        servers[name] = stack.enter_context(
            ServerProcess(spec, {"slowdown": slow, "threads": args.torch_threads}, args.log_dir, name=name))
        stack.callback(timed_stop, servers[name], name, stopped)  # runs before the context's own (no-op) stop
        one_run(servers[name], sc)  # first requests pay one-off costs
        ready[name] = time.perf_counter() - t0
    return servers, ready


def timed_stop(server: ServerProcess, name: str, stopped: dict[str, float]) -> None:
    """Stop one server and add the seconds it took to ``stopped[name]``: a comparison waits for it."""
    t0 = time.perf_counter()
    server.stop()
    stopped[name] = stopped.get(name, 0.0) + time.perf_counter() - t0


def analyse_trial(trial: dict[str, Any], pairs: int, restarts: int) -> tuple[list[float], list[float], list[float], list[float], list[list[float]], float]:
    """From one trial's stored runs: paired A/A2 and A/B throughputs, the A/A log ratios of
    each restart block, and the comparison's wall time (starting, warming and stopping A
    and B at every restart, plus their runs)."""
    a, a2 = paired(trial["A"], trial["A2"])
    a_b, b = paired(trial["A"], trial["B"])
    blocks = []
    for lo, hi in restart_blocks(pairs, restarts):
        a_r, a2_r = paired(trial["A"][lo:hi], trial["A2"][lo:hi])
        blocks.append([math.log(y / x) for x, y in zip(a_r, a2_r)])
    stop = trial.get("stop_s", {})  # not stored by runs before stopping was timed
    wall = (trial["ready_s"]["A"] + trial["ready_s"]["B"] + stop.get("A", 0.0) + stop.get("B", 0.0)
            + sum(r["wall_s"] for r in trial["A"] + trial["B"]))
    return a, a2, a_b, b, blocks, wall


def resampled_fpr(aa_pairs: list[tuple[float, float]], n: int, reps: int, seed: int = 11) -> float:
    """How often the judge's interval excludes 1 on comparisons of n pairs redrawn from the
    pooled A/A pairs (centred on the null): a check that the interval is calibrated for
    this noise, with more comparisons than the trials can afford."""
    rng = np.random.default_rng(seed)
    pool = np.array(aa_pairs, dtype=float)
    # Centre the pool on the null (A2's mean scaled to A's): the pool's own chance
    # deviation from 1 would otherwise count as false positives in every redraw.
    pool[:, 1] *= pool[:, 0].mean() / pool[:, 1].mean()
    hits = 0
    for r in range(reps):
        pick = pool[rng.integers(0, len(pool), size=n)]
        ci = bootstrap_ratio(pick[:, 1], pick[:, 0], stat="mean", paired=True, seed=1000 + r)
        hits += not (ci.low <= 1.0 <= ci.high)
    return hits / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="comparisons of each kind (A/A and A/B)")
    ap.add_argument("--pairs", type=int, default=110, help="interleaved runs per side in one comparison")
    ap.add_argument("--requests", type=int, default=16, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slowdown", type=float, default=0.05, help="the true change B carries")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="engine threads per server; 1 keeps three servers from oversubscribing 2 cores")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/ab_power_logs"))
    ap.add_argument("--server-cpus", default=None, help="pin the servers to these CPUs (taskset list, e.g. 0)")
    ap.add_argument("--client-cpus", default=None, help="pin this process, the client, to these CPUs (e.g. 1)")
    ap.add_argument("--raw", type=Path, default=None, help="write every run's numbers here (JSON)")
    ap.add_argument("--from-raw", type=Path, default=None,
                    help="run nothing: judge the runs stored by an earlier --raw (e.g. with another --process-noise)")
    ap.add_argument("--resamples", type=int, default=400, help="redrawn A/A comparisons for the calibration check")
    ap.add_argument("--restarts", type=int, default=1, help="fresh server processes per side in one comparison")
    ap.add_argument("--process-noise", default="0",
                    help="the judge's per-process spread (sd of log ratio) from an earlier calibration run, or 'loo': "
                         "each trial's from the other trials' A/A blocks (leave one out)")
    args = ap.parse_args()
    spec = SPEC
    if args.server_cpus:
        spec = SPEC.model_copy(update={"command": ["taskset", "-c", args.server_cpus, *SPEC.command]})
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    sc = Scenario.model_validate({
        "dataset": {"kind": "random", "input_len": args.input_len, "output_len": args.output_len, "seed": 1},
        "num_requests": args.requests, "max_concurrency": args.concurrency, "temperature": 1.0,
    })

    raw: list[dict[str, Any]] = []
    if args.from_raw:
        stored = json.loads(args.from_raw.read_text())
        raw = stored["trials"]
        for key in ("pairs", "restarts", "requests", "concurrency", "slowdown"):  # what the runs were made with
            setattr(args, key, type(getattr(args, key))(stored["args"][key]))
        args.trials = len(raw)
    for t in range(0 if args.from_raw else args.trials):
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "A2": [], "B": []}
        ready: dict[str, float] = {"A": 0.0, "A2": 0.0, "B": 0.0}
        stopped: dict[str, float] = {}
        for r, (first, end) in enumerate(restart_blocks(args.pairs, args.restarts)):
            with ExitStack() as stack:
                servers, ready_r = start_servers(stack, spec, args, sc, START_ORDERS[r % len(START_ORDERS)], stopped)
                block_runs = cycle(servers, ["A", "A2", "B"], sc, end - first)
            for side in runs:
                runs[side] += block_runs[side]
                ready[side] += ready_r[side]
        raw.append({"ready_s": ready, "stop_s": stopped, **{side: [{k: r.get(k) for k in ("output_throughput", "duration", "wall_s", "failed")}
                                                for r in rs] for side, rs in runs.items()}})
        if args.raw:
            args.raw.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "trials": raw}))
        a, a2, a_b, b, _, wall = analyse_trial(raw[-1], args.pairs, args.restarts)
        print(f"trial {t}: A/A {statistics.mean(a2) / statistics.mean(a):.3f}  A/B {statistics.mean(b) / statistics.mean(a_b):.3f}  "
              f"comparison {wall:.0f}s", file=sys.stderr, flush=True)

    aa_pairs: list[tuple[float, float]] = []
    ab_logs: list[float] = []
    walls: list[float] = []
    aa_blocks: list[list[list[float]]] = []  # per trial, per restart: the A/A log ratios
    sides: list[dict[str, list[float]]] = []  # per trial: paired A, A2 (with A) and B (with A) throughputs
    for trial in raw:
        a, a2, a_b, b, blocks, wall = analyse_trial(trial, args.pairs, args.restarts)
        sides.append({"a": a, "a2": a2, "a_b": a_b, "b": b})
        aa_blocks.append(blocks)
        aa_pairs += list(zip(a, a2))
        ab_logs += [math.log(y / x) for x, y in zip(a_b, b)]
        walls.append(wall)

    # The judge's verdicts.  With --process-noise loo, trial t's interval uses the spread
    # estimated from the *other* trials' A/A blocks: calibrated on comparisons of the same
    # target and machine, never on the one it judges.
    fp = det = det5 = 0
    taus: list[float] = []
    for t, sd_t in enumerate(sides):
        if args.process_noise == "loo":
            tau_t = process_noise_estimate([blk for u, blocks in enumerate(aa_blocks) if u != t for blk in blocks])[0]
        else:
            tau_t = float(args.process_noise)
        taus.append(tau_t)
        ci_aa = bootstrap_ratio(sd_t["a2"], sd_t["a"], stat="mean", paired=True, seed=100 + t,
                                process_noise=tau_t, restarts=args.restarts)
        ci_ab = bootstrap_ratio(sd_t["b"], sd_t["a_b"], stat="mean", paired=True, seed=200 + t,
                                process_noise=tau_t, restarts=args.restarts)
        fp += not (ci_aa.low <= 1.0 <= ci_aa.high)
        det += ci_ab.high < 1.0
        # An exactly 5% slower B with real noise: A2's runs x 0.95.  The ratio of means
        # scales exactly, so that interval is this A/A interval x 0.95.
        det5 += 0.95 * ci_aa.high < 1.0
        print(f"trial {t}: process noise {tau_t:.2%}  A/A {ci_aa.ratio:.3f} [{ci_aa.low:.3f},{ci_aa.high:.3f}]  "
              f"A/B {ci_ab.ratio:.3f} [{ci_ab.low:.3f},{ci_ab.high:.3f}]", file=sys.stderr, flush=True)

    n = args.pairs
    aa_logs = [math.log(y / x) for x, y in aa_pairs]
    sd = statistics.stdev(aa_logs) if len(aa_logs) > 1 else float("nan")
    # The judge's standard error: the pairs' own, plus the process spread over the
    # restarts that its interval adds.  Paired design, two-sided 95%, 90% power:
    # MDE = (t_.975 + t_.90)·se.
    tau_judge = statistics.mean(taus)
    se = math.sqrt(sd**2 / n + tau_judge**2 / args.restarts)
    mde = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.90, n - 1)) * se
    # Power a paired t-style test of this size would have against a true 5% change.
    nc = -math.log(1 - 0.05) / se
    power_5 = 1 - stats.nct.cdf(stats.t.ppf(0.975, n - 1), n - 1, nc)
    fpr_ci, pow_ci, pow5_ci = wilson(fp, args.trials), wilson(det, args.trials), wilson(det5, args.trials)
    # B's drop from the mean log ratio; its interval is the mean's, mapped through 1 - e^x.
    ab_mean = statistics.mean(ab_logs)
    ab_se = statistics.stdev(ab_logs) / math.sqrt(len(ab_logs))
    drop, drop_lo, drop_hi = (1 - math.exp(ab_mean + z * ab_se) for z in (0.0, 1.96, -1.96))
    rs_fpr = resampled_fpr(aa_pairs, n, args.resamples)
    tau, f_stat, f_df, f_p = process_noise_estimate([blk for blocks in aa_blocks for blk in blocks])
    rows = [
        ("trials (each kind)", f"{args.trials}", "fresh servers every trial"),
        ("pairs per comparison x requests per run", f"{n} x {args.requests}", f"concurrency {args.concurrency}"),
        ("restarts per comparison; judge's process noise", f"{args.restarts}; {min(taus):.2%}-{max(taus):.2%}",
         "fresh servers per restart; the spread the interval adds over them"
         + (" (each trial: estimated from the other trials)" if args.process_noise == "loo" else "")),
        ("step slowdown for B", f"{args.slowdown:g}", "refstack --step-slowdown"),
        ("B's realised throughput drop, pooled", f"{drop:.1%}", f"95% CI [{drop_lo:.1%}, {drop_hi:.1%}], {len(ab_logs)} pairs"),
        ("false-positive rate (A/A)", f"{fp}/{args.trials} = {fp / args.trials:.0%}", f"Wilson 95% [{fpr_ci[0]:.0%}, {fpr_ci[1]:.0%}]; goal <= 5%"),
        ("false-positive rate, A/A pairs redrawn", f"{rs_fpr:.1%}", f"{args.resamples} comparisons of {n} pairs from the pooled {len(aa_pairs)}"),
        ("power (A/B), at B's realised drop", f"{det}/{args.trials} = {det / args.trials:.0%}", f"Wilson 95% [{pow_ci[0]:.0%}, {pow_ci[1]:.0%}]"),
        ("power against an exact 5% drop (A2's runs x 0.95)", f"{det5}/{args.trials} = {det5 / args.trials:.0%}",
         f"Wilson 95% [{pow5_ci[0]:.0%}, {pow5_ci[1]:.0%}]; goal >= 90%"),
        ("wall time per comparison [s]", f"{statistics.median(walls):.0f}", f"max {max(walls):.0f}; both servers' start and stop included; goal <= 120"),
        ("paired run-to-run noise (sd of log ratio)", f"{sd:.1%}", "from the A/A pairs"),
        ("process noise estimated here (tau)", f"{tau:.2%}",
         f"A/A blocks, random-effects ANOVA; F = {f_stat:.2f} on {f_df} df, p = {f_p:.2f}; calibrates the next run"),
        ("power against a true 5% change (from that noise)", f"{power_5:.0%}", "noncentral t, same pairs"),
        ("min detectable effect at this budget", f"{mde:.1%}", "90% power, 95% two-sided; ratio to the 5% goal: " + f"{mde / 0.05:.2f}x"),
    ]
    w = max(len(r[0]) for r in rows)
    if args.server_cpus or args.client_cpus:
        print(f"pinned: servers on CPU(s) {args.server_cpus}, client on CPU(s) {args.client_cpus}\n")
    print(f"| {'quantity'.ljust(w)} | value | note |\n|{'-' * (w + 2)}|---|---|")
    for name, value, note in rows:
        print(f"| {name.ljust(w)} | {value} | {note} |")


if __name__ == "__main__":
    main()
