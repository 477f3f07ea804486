"""False positives and power of the judge's designs: fixed looks against sequential looks.

    python bench/ab_designs.py --from-raw runs.json [--pairs 3 6 12] [--batch 3] [--effect 0.05]
                               [--batches one|fresh] [--judge-noise 0|loo|TAU]
    python bench/ab_designs.py --synthetic 0.05 [--comparisons 20000] [--process-noise 0.01] [--judge-noise TAU]

The judge decides on the geometric mean of per-pair ratios with a t-interval on their logs
(stats/intervals.py).  An experiment is either one look at ``n`` pairs (the fixed design,
95%), or batches of ``--batch`` pairs looked at after each one, up to ``n``, with Pocock's
per-look level (judge/sequential.py), stopping at the first look whose interval decides.

**Protocol** (``--from-raw``): the runs ``bench/ab_power.py --raw`` stored, real refstack
servers on this machine.  Every trial ran cycles of A, A2 (the same configuration as A in
a second process) and B.  Each trial's cycles are cut into disjoint blocks of ``n`` pairs;
each block is one comparison:

- A/A: A against A2.  A false positive is a look whose interval excludes 1 (for the
  sequential design: any look before it stops).  Goal: at most 5%.
- power at an exact effect: A against A2's runs times ``1 - effect``, i.e. a side exactly
  ``effect`` slower carrying the real noise; detected when a look's interval lies wholly
  below 1.  Reported with the mean pairs each design spent.

``--batches fresh`` lays the comparisons out as the loop does: every batch of ``--batch``
pairs on its own fresh process pair, i.e. one restart block of ``ab_power.py --restarts``
per batch, blocks drawn at random (seeded) from different restarts, ``--comparisons`` of
them.  ``--batches one`` (default) keeps a comparison on consecutive cycles of one trial.
``--judge-noise`` is the spread between processes the judge's interval adds over the
batches behind each look (judge/process_noise.py): a number, or ``loo``, estimated from
the restart blocks of the *other* trials (one-way random-effects ANOVA, as
``infra-agent calibrate``, and used only where its F test shows a spread, as ``run
--process-noise auto`` does), never from the comparison it judges.

**Simulation** (``--synthetic SD``): the same on log-normal pairs of spread ``SD`` (per-pair
log ratio), plus an offset of spread ``--process-noise`` redrawn every batch (two fresh
processes differ), so that the rates are known to a fraction of a percent.

It prints one table: per design and pairs, the false-positive rate with its Wilson 95%
interval, the power, and the mean pairs used; the ratio against the 5% goal is the
false-positive column itself.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from infra_agent.judge.process_noise import shows_spread
from infra_agent.judge.sequential import SequentialDesign
from infra_agent.stats.intervals import log_ratio_interval
from infra_agent.stats.process_noise import between_process_spread


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def judge(ratios: np.ndarray, design: SequentialDesign, direction: str, tau: float = 0.0,
          batch: int | None = None) -> tuple[bool, int]:
    """(decided at some look, pairs used): ``direction`` 'excludes1' (A/A) or 'below1' (a slower side).

    ``tau``: the process term over ``ceil(n / batch)`` fresh process pairs (``batch`` None: one)."""
    for look in range(1, design.looks + 1):
        n = min(look * design.batch, ratios.size)
        restarts = math.ceil(n / batch) if batch else 1
        ci = log_ratio_interval(ratios[:n].tolist(), confidence=design.confidence, process_noise=tau,
                                restarts=restarts)
        hit = ci.high < 1.0 if direction == "below1" else not (ci.low <= 1.0 <= ci.high)
        if hit:
            return True, n
        if n == ratios.size:
            break
    return False, min(design.max_pairs, ratios.size)


def blocks_from_raw(path: Path, n: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Disjoint blocks of ``n`` consecutive cycles of each trial: (A, A2) throughputs."""
    stored = json.loads(path.read_text())
    for trial in stored["trials"]:
        pairs = [(a["output_throughput"], b["output_throughput"]) for a, b in zip(trial["A"], trial["A2"], strict=False)
                 if a.get("output_throughput") and b.get("output_throughput") and not a.get("failed") and not b.get("failed")]
        for start in range(0, len(pairs) - n + 1, n):
            block = np.asarray(pairs[start:start + n], dtype=np.float64)
            yield block[:, 0], block[:, 1]


def restart_blocks_from_raw(path: Path) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Every restart block of every trial: (trial, A, A2) throughputs of its cycles, on one fresh process set."""
    stored = json.loads(path.read_text())
    pairs, restarts = int(stored["args"]["pairs"]), int(stored["args"].get("restarts", 1))
    out = []
    for t, trial in enumerate(stored["trials"]):
        for r in range(restarts):
            lo, hi = pairs * r // restarts, pairs * (r + 1) // restarts
            kept = [(a["output_throughput"], b["output_throughput"]) for a, b in zip(trial["A"][lo:hi], trial["A2"][lo:hi],
                                                                                    strict=False)
                    if a.get("output_throughput") and b.get("output_throughput") and not a.get("failed")
                    and not b.get("failed")]
            if kept:
                block = np.asarray(kept, dtype=np.float64)
                out.append((t, block[:, 0], block[:, 1]))
    return out


def fresh_batches(blocks: list[tuple[int, np.ndarray, np.ndarray]], n: int, batch: int, count: int,
                  seed: int) -> Iterator[tuple[set[int], np.ndarray, np.ndarray]]:
    """Comparisons of ``n`` pairs as the loop runs them: each batch the first ``batch`` cycles of a
    different restart block.  Yields (the trials used, A, A2)."""
    usable = [b for b in blocks if b[1].size >= batch]
    k = math.ceil(n / batch)
    if len(usable) < k:
        return
    rng = np.random.default_rng(seed)
    for _ in range(count):
        picked = [usable[i] for i in rng.choice(len(usable), size=k, replace=False)]
        a = np.concatenate([p[1][:batch] for p in picked])[:n]
        a2 = np.concatenate([p[2][:batch] for p in picked])[:n]
        yield {p[0] for p in picked}, a, a2


def loo_tau(blocks: list[tuple[int, np.ndarray, np.ndarray]], leave_out: set[int]) -> float:
    """The spread between processes from the restart blocks of the trials not in ``leave_out``,
    used as the loop's ``--process-noise auto`` uses a calibration: only where its F test
    shows a spread (judge/process_noise.py ``shows_spread``)."""
    logs = [list(np.log(a2 / a)) for t, a, a2 in blocks if t not in leave_out]
    spread = between_process_spread(logs)
    return spread.tau if shows_spread(None if math.isnan(spread.p) else spread.p) else 0.0


def synthetic_blocks(sd: float, tau: float, n: int, count: int, seed: int,
                     batch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Log-normal pairs of per-pair spread ``sd``; B's process offset (spread ``tau``) is redrawn
    every ``batch`` pairs, as every batch of the loop starts fresh servers."""
    rng = np.random.default_rng(seed)
    batches = math.ceil(n / batch)
    for _ in range(count):
        offsets = np.repeat(rng.normal(0.0, tau, batches), batch)[:n]
        a = np.exp(rng.normal(0.0, sd / math.sqrt(2), n))
        b = np.exp(offsets + rng.normal(0.0, sd / math.sqrt(2), n))
        yield 100 * a, 100 * b


def comparisons(args: argparse.Namespace, n: int) -> Iterator[tuple[float, np.ndarray, np.ndarray]]:
    """(the judge's tau, A, A2) per comparison of ``n`` pairs."""
    fixed_tau = 0.0 if args.judge_noise in ("0", "loo") else float(args.judge_noise)
    if args.synthetic is not None:
        for a, a2 in synthetic_blocks(args.synthetic, args.process_noise, n, args.comparisons, args.seed + n,
                                     args.batch):
            yield fixed_tau, a, a2
        return
    if args.batches == "one":
        for a, a2 in blocks_from_raw(args.from_raw, n):
            yield fixed_tau, a, a2
        return
    blocks = restart_blocks_from_raw(args.from_raw)
    cache: dict[frozenset[int], float] = {}
    for trials, a, a2 in fresh_batches(blocks, n, args.batch, args.comparisons, args.seed + n):
        if args.judge_noise == "loo":
            key = frozenset(trials)
            if key not in cache:
                cache[key] = loo_tau(blocks, trials)
            yield cache[key], a, a2
        else:
            yield fixed_tau, a, a2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-raw", type=Path, help="runs stored by bench/ab_power.py --raw")
    src.add_argument("--synthetic", type=float, help="per-pair log-ratio spread of simulated comparisons")
    ap.add_argument("--pairs", type=int, nargs="+", default=[3, 6, 12], help="pairs per comparison (the cap)")
    ap.add_argument("--batch", type=int, default=3, help="pairs per look of the sequential design")
    ap.add_argument("--effect", type=float, default=0.05, help="the exact slowdown of the power rows")
    ap.add_argument("--comparisons", type=int, default=20000,
                    help="simulated comparisons per row (--synthetic), or drawn ones (--batches fresh)")
    ap.add_argument("--process-noise", type=float, default=0.0, help="per-comparison offset sd (--synthetic)")
    ap.add_argument("--batches", choices=["one", "fresh"], default="one",
                    help="--from-raw: a comparison on one process pair, or each batch on a fresh one (the loop)")
    ap.add_argument("--judge-noise", default="0", help="the process term the judge adds: 0, a spread, or loo")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.judge_noise == "loo" and (args.from_raw is None or args.batches != "fresh"):
        ap.error("--judge-noise loo needs --from-raw with --batches fresh")

    rows = []
    taus: list[float] = []
    for n in args.pairs:
        designs = [("fixed, one look", SequentialDesign(looks=1, batch=n))]
        if n > args.batch:
            designs.append((f"sequential, looks of {args.batch}", SequentialDesign(looks=math.ceil(n / args.batch),
                                                                                  batch=args.batch)))
        batch = args.batch if (args.batches == "fresh" or args.synthetic is not None) else None
        for name, design in designs:
            fp = det = 0
            used_aa: list[int] = []
            used_ab: list[int] = []
            for tau, a, a2 in comparisons(args, n):
                taus.append(tau)
                hit, used = judge(a2 / a, design, "excludes1", tau, batch)
                fp += hit
                used_aa.append(used)
                hit, used = judge((1 - args.effect) * a2 / a, design, "below1", tau, batch)
                det += hit
                used_ab.append(used)
            m = len(used_aa)
            lo, hi = wilson(fp, m)
            plo, phi = wilson(det, m)
            rows.append((n, name, f"{design.confidence:.1%}", m, f"{fp / m:.1%} [{lo:.1%}, {hi:.1%}]" if m else "-",
                         f"{det / m:.0%} [{plo:.0%}, {phi:.0%}]" if m else "-",
                         f"{np.mean(used_aa):.1f} / {np.mean(used_ab):.1f}" if m else "-"))
    source = (f"runs of {args.from_raw}, batches: {args.batches}" if args.from_raw else
              f"simulated: per-pair sd {args.synthetic:.1%}, process noise {args.process_noise:.1%}, one fresh process "
              f"pair per batch of {args.batch}")
    judged = f"judge's process term {min(taus):.2%}-{max(taus):.2%}" if taus and max(taus) > 0 else "no process term"
    print(f"source: {source}; {judged}; effect for power: exact {args.effect:.0%} slower; goal: false positives <= 5%\n")
    print("| pairs (cap) | design | per-look interval | comparisons | A/A false positives [Wilson 95%] "
          f"| power at {args.effect:.0%} | mean pairs used (A/A / {args.effect:.0%}) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
