"""ReplaySSM against per-step state snapshots: bytes held per slot, rollback and per-step cost.

    python bench/replay_ssm.py [--device cuda|cpu] [--quick] [--windows 2 4 8] [--slots 1 8 32 128]
                               [--heads 32] [--dim 128] [--fold-batch 1] [--rounds 3] [--threads 1]
                               [--json out.json]

For each window W and slot count N, one layer's store of each kind is filled (rings
full, at the phase just before a fold), then these are timed for all N slots at once,
each rep a fresh call:

- rollback by 1 step, the worst case for replay (W + F - 2 retained inputs to replay
  with fold batch F; W - 1 at the default F = 1) and the usual one in speculative
  decoding: the snapshot copy, and the replay with each engine forced (recurrent loop,
  kda_chunked), written into the live state;
- the per-step bookkeeping: snapshot ``record`` (one state copy per slot) against replay
  ``record`` (one packed input write per slot, plus the fold into the checkpoint with
  the default engine choice, amortised over the F steps of a fold cycle);
- the KDA decode step itself (kda_recurrent_step on N slots), for scale.

Repeats are interleaved: each round times every variant once, in an order rotated per
round, so drift on a shared machine hits all variants alike.  GPU: two clocks, CUDA
events with L2 flushed before each rep (infra_agent.lab.timing: device time), and
perf_counter around each call plus a synchronise ("wall": host bookkeeping and kernel
launches included, which dominate at small N and which events may not see); CPU:
perf_counter, one thread by default.  Medians with a 95% bootstrap CI over all samples.  Bytes exclude the live state, which both keep.
Defaults: cuda if available with the case study's H=32, K=V=128; else cpu with H=4,
K=V=64 (the case-study bytes are printed as arithmetic in any case).
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from infra_agent.lab.timing import bootstrap_median_ci, time_call, time_cpu
from refstack.model.kda_ops import kda_recurrent_step
from refstack.model.replay_ssm import ReplaySSM, SnapshotSSM

VARIANTS = ["rollback snapshot", "rollback replay-recurrent", "rollback replay-chunked",
            "record snapshot", "record replay", "decode step"]
CLOCKS = ["events", "wall"]  # on GPU: CUDA events (device time), and wall clock synchronised per call


def case_bytes(H: int, K: int, V: int, window: int, fold_batch: int, input_bytes: int = 4) -> dict[str, float]:
    """Bytes per slot and layer beyond the live state, by arithmetic (no allocation)."""
    snap = window * H * K * V * 4
    replay = H * K * V * 4 + (window + fold_batch - 1) * H * (2 * K + V + 1) * input_bytes
    return {"snapshot": snap, "replay": replay, "saved_x": snap / replay}


def step_inputs(N: int, H: int, K: int, V: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Inputs shaped like KDALayer.project's: unit-norm q, k; g <= 0; beta in (0, 1)."""
    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)
    q, k = F.normalize(rnd(N, H, K), dim=-1), F.normalize(rnd(N, H, K), dim=-1)
    g = -0.1 * torch.rand(N, H, K, generator=gen).to(device)
    return q, k, rnd(N, H, V), g, torch.rand(N, H, generator=gen).to(device)


def synced(fn: Callable[[], object], device: str) -> Callable[[], None]:
    def call() -> None:
        fn()
        torch.cuda.synchronize(device)
    return call


def measure(W: int, N: int, args: argparse.Namespace) -> dict[str, Any]:
    H, K, V, dev = args.heads, args.dim, args.dim, args.device
    gen = torch.Generator().manual_seed(W * 1000 + N)
    slots = list(range(N))
    F_ = args.fold_batch
    # The default engine choice (record replay), and each engine forced (rollbacks).
    replay, recurrent, chunked = (ReplaySSM(torch.zeros(N, H, K, V, device=dev), W, fold_batch=F_, chunked_from=c)
                                  for c in ("auto", None, 1))
    snap = SnapshotSSM(torch.zeros(N, H, K, V, device=dev), W)
    # Full rings, at the phase just before a fold, where a rollback replays the most
    # (W + F - 2 steps); a record cycle of F steps comes back to it.
    for _ in range(W + 2 * F_ - 1):
        step = step_inputs(N, H, K, V, dev, gen)
        for store in (replay, recurrent, chunked, snap):
            store.append(slots, *step)
    q, k, v, g, beta = step_inputs(N, H, K, V, dev, gen)
    decode_state = torch.randn(N, H, K, V, generator=gen).to(dev)

    def restore(store: ReplaySSM | SnapshotSSM) -> Callable[[], object]:
        def fn() -> None:
            store.rollback(slots, 1)
            # Re-admit the undone step (its input or snapshot is still in the ring), so every
            # rep replays the same W - 1 steps; the live state's value does not matter here.
            store.count[:N] += 1
        return fn

    def record_replay() -> None:
        for _ in range(args.fold_batch):  # one whole fold cycle, reported per step below
            replay.record(slots, k, v, g, beta)

    fns: dict[str, Callable[[], object]] = {
        "rollback snapshot": restore(snap),
        "rollback replay-recurrent": restore(recurrent),
        "rollback replay-chunked": restore(chunked),
        "record snapshot": lambda: snap.record(slots),
        "record replay": record_replay,
        "decode step": lambda: kda_recurrent_step(q, k, v, g, beta, decode_state, replay.scale, inplace=True),
    }
    clocks = CLOCKS if dev.startswith("cuda") else ["wall"]
    samples: dict[str, dict[str, list[float]]] = {c: {name: [] for name in VARIANTS} for c in clocks}
    for r in range(args.rounds):
        for name in VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]:
            per = args.fold_batch if name == "record replay" else 1
            fn = fns[name]
            if "events" in samples:
                samples["events"][name] += [s / per for s in time_call(fn, dev, budget_s=args.budget).samples_s]
                # Synchronised per call: host bookkeeping and launches included, which events
                # only partly see (the driver may hand the GPU a whole call's launches at once).
                fn = synced(fns[name], dev)
            samples["wall"][name] += [s / per for s in time_cpu(fn, budget_s=args.budget).samples_s]
    timings: dict[str, dict[str, dict[str, float]]] = {c: {} for c in clocks}
    for clock, per_variant in samples.items():
        for name, xs in per_variant.items():
            lo, hi = bootstrap_median_ci(xs)
            timings[clock][name] = {"median_s": float(np.median(xs)), "ci_low_s": lo, "ci_high_s": hi, "n": len(xs)}
    return {"window": W, "slots": N, "bytes_per_slot": {"snapshot": snap.bytes_per_slot(),
            "replay": replay.bytes_per_slot()}, "timings": timings}


def us(t: dict[str, float]) -> str:
    return f"{t['median_s'] * 1e6:.1f} [{t['ci_low_s'] * 1e6:.1f},{t['ci_high_s'] * 1e6:.1f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="fewer samples per variant (CPU: < 2 min)")
    p.add_argument("--windows", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--heads", type=int, default=None, help="H (default 32 on cuda, 4 on cpu)")
    p.add_argument("--dim", type=int, default=None, help="K = V (default 128 on cuda, 64 on cpu)")
    p.add_argument("--fold-batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick 2)")
    p.add_argument("--budget", type=float, default=None, help="CPU seconds per variant per round")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1: a busy box perturbs one thread least)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    args.heads = args.heads or (32 if gpu else 4)
    args.dim = args.dim or (128 if gpu else 64)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.budget = args.budget or (0.01 if args.quick else 0.1)
    torch.set_grad_enabled(False)
    if not gpu:
        torch.set_num_threads(args.threads)

    print(f"# bytes per slot and layer at the case study's H=32, K=V=128 (fp32 inputs, fold batch {args.fold_batch})")
    print("| window | snapshots | replay | saved |\n|---|---|---|---|")
    for W in args.windows:
        b = case_bytes(32, 128, 128, W, args.fold_batch)
        print(f"| {W} | {b['snapshot']:,.0f} | {b['replay']:,.0f} | {b['saved_x']:.2f}x |")

    name = torch.cuda.get_device_name(args.device) if gpu else platform.processor() or platform.machine()
    print(f"\n# measured on {args.device} ({name}), H={args.heads}, K=V={args.dim}, fold batch {args.fold_batch}; "
          f"us per call for all N slots, median [95% CI]; rollback = 1 step back")
    cols = ["W", "N", "bytes snap", "bytes replay", "saved", "clock", *VARIANTS, "faster replay"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    rows = []
    for W in args.windows:
        for N in args.slots:
            row = measure(W, N, args)
            rows.append(row)
            b = row["bytes_per_slot"]
            for clock, t in row["timings"].items():
                faster = min(["recurrent", "chunked"], key=lambda e: t[f"rollback replay-{e}"]["median_s"])
                print(f"| {W} | {N} | {b['snapshot']:,} | {b['replay']:,} | {b['snapshot'] / b['replay']:.2f}x | "
                      f"{clock} | " + " | ".join(us(t[v]) for v in VARIANTS) + f" | {faster} |", flush=True)
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        case = {W: case_bytes(32, 128, 128, W, args.fold_batch) for W in args.windows}
        with open(args.json, "w") as f:
            json.dump({"args": meta, "device_name": name, "case_study_bytes": case, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
