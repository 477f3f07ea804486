"""KDA decode on one GPU: refstack's Triton kernel against fla-core's, against the copy ceiling.

    python bench/kda_decode.py                      # the table of the case study
    python bench/kda_decode.py --sweep              # every launch config, best per N
    python bench/kda_decode.py --json               # machine-readable

Per batch size N (H=32, K=V=128, bf16 inputs, fp32 state in a pool of 2N slots, norm/
gate/beta computed in the kernel) and per slot order, in one run:

1. correctness first: every implementation against the float64 reference, on the
   output and on the updated state rows; one that fails is not timed;
2. the copy ceiling: a device-to-device copy of a 1 GiB buffer, best of its reps;
3. GPU time per step with the launch hidden (see ``hidden_launch_time``) and the
   host's per-call cost beside it, as its own number;
4. a plain copy of each step's bytes (half read, half written), timed the same way:
   what any kernel moving them reaches at that size in this timing (at N=8 it is far
   from the ceiling), and ours against it.

Bytes per step = state read + write (fp32) + q, k, g, v, beta and the output, the
accounting of fla-core's figures in the project's anchors.

Slot orders (``--slots``): ``ascending`` is what refstack's engine presents, a random
half of the pool sorted (the engine orders its decode batch by slot, and finished
sequences leave holes); ``shuffled`` is the same pool in no order, the harder case of a
server that does not sort.  Both peers get the same inputs in each row.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from infra_agent.lab.timing import time_cuda
from refstack.kernels.kda_decode_ref import SLOT_ORDERS

H, K, V = 32, 128, 128
NS = (1, 8, 32, 128, 512)
EPS = 1e-6  # fla-core's in-kernel L2-norm epsilon, used by both sides
TOL_STATE = 1e-5  # relative Frobenius error of the fp32 state vs float64 (fp32 sums over K)
TOL_OUT = 5e-3  # relative Frobenius error of the bf16 output (bf16 rounding is ~2^-9)


def step_bytes(n: int, el: int = 2) -> int:
    return n * H * (2 * K * V * 4 + (3 * K + 2 * V + 1) * el)


def hidden_launch_time(fn: Callable[[], Any], reps: int = 60) -> dict[str, float]:
    """GPU seconds per call with the host's launch cost hidden, plus that host cost.

    The kernel lab's default GPU timing (``time_cuda``, ``cuda_events_delayed``): per
    rep, flush L2, queue a GPU spin a few times the host's per-call cost, then start
    event, fn(), end event, so the events bracket GPU work only.  The host cost is the
    median wall time of back-to-back calls, unsynchronised.
    """
    t = time_cuda(fn, reps=reps, method="cuda_events_delayed")
    return {"gpu_s": t.median_s, "gpu_best_s": t.best_s, "ci_low_s": t.ci_low_s, "ci_high_s": t.ci_high_s,
            "host_s": float(t.host_median_s or 0.0)}


def copy_ceiling() -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted), best rep."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = hidden_launch_time(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / t["gpu_best_s"]


def fla_step() -> Callable[..., Any] | None:
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
        print(f"fla-core not available ({type(exc).__name__}: {exc}); its column is left out", file=sys.stderr)
        return None

    def step(q, k, v, f, b, state, slots, *, A_log, dt_bias, out):  # type: ignore[no-untyped-def]
        n, h, kk = q.shape
        fused_recurrent_kda_fwd(
            q=q.view(n, 1, h, kk), k=k.view(n, 1, h, kk), v=v.view(n, 1, h, -1), g=f.view(n, 1, h, kk),
            beta=b.view(n, 1, h), A_log=A_log, dt_bias=dt_bias, initial_state=state, scale=kk**-0.5,
            inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, out=out.view(n, 1, h, -1))
        return out
    return step


def rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def implementations(sweep: bool) -> dict[str, Callable[..., Any]]:
    from functools import partial

    from refstack.kernels.kda_decode import LaunchConfig, kda_decode

    impls: dict[str, Callable[..., Any]] = {
        "ours-auto": partial(kda_decode, form="auto", eps=EPS),
        "ours-fused": partial(kda_decode, form="fused", eps=EPS),
        "ours-tiled": partial(kda_decode, form="tiled", eps=EPS),
    }
    if sweep:
        for cols in (16, 32, 64, 128):
            for bv in (16, 32, 64, 128):
                for warps in (1, 2, 4, 8, 16):
                    for evict, prefetch in (("evict_first", False), ("", False), ("", True)):
                        if bv <= cols and bv * K // (32 * warps) >= 4 and not (prefetch and bv == cols):
                            name = f"cols{cols}-bv{bv}-w{warps}{'-noevict' if not evict else ''}{'-prefetch' if prefetch else ''}"
                            impls[name] = partial(kda_decode, eps=EPS, config=LaunchConfig(cols, bv, warps, evict, prefetch))
    fla = fla_step()
    if fla is not None:
        impls["fla-core"] = fla
    return impls


def run(ns: tuple[int, ...], sweep: bool, slot_orders: tuple[str, ...] = SLOT_ORDERS) -> dict[str, Any]:
    from refstack.kernels.kda_decode_ref import kda_decode_inputs, kda_decode_reference

    ceiling = copy_ceiling()
    # The floor any one-kernel step pays in this timing: a one-element kernel.
    tiny = torch.zeros(1, device="cuda")
    floor_s = hidden_launch_time(tiny.zero_)["gpu_s"]
    impls = implementations(sweep)
    rows = []
    for n, order in ((n, order) for n in ns for order in slot_orders):
        x = kda_decode_inputs(n, H, K, V, num_slots=2 * n, dtype=torch.bfloat16, device="cuda", seed=n,
                              slot_order=order)
        o_ref, s_ref = kda_decode_reference(**{k_: x[k_] for k_ in ("q", "k", "v", "f", "b", "state", "slots")},
                                            A_log=x["A_log"], dt_bias=x["dt_bias"], eps=EPS)
        row: dict[str, Any] = {"N": n, "slots": order, "bytes": step_bytes(n), "impls": {}}
        # A plain copy of the step's bytes (half read, half written), timed the same way: what any
        # kernel moving them can reach at this size in this timing (the kernel lab's copy_same_bytes).
        src = torch.empty(step_bytes(n) // 8, dtype=torch.float32, device="cuda")
        dst = torch.empty_like(src)
        row["copy_same_bytes"] = hidden_launch_time(lambda: dst.copy_(src))
        del src, dst
        for name, fn in impls.items():
            state = x["state"].clone()
            out = torch.empty_like(x["v"])
            args = dict(q=x["q"], k=x["k"], v=x["v"], f=x["f"], b=x["b"], state=state, slots=x["slots"])
            fn(**args, A_log=x["A_log"], dt_bias=x["dt_bias"], out=out)
            torch.cuda.synchronize()
            err_o = rel_fro(out, o_ref)
            err_s = rel_fro(state.index_select(0, x["slots"].long()), s_ref)
            entry: dict[str, Any] = {"err_out": err_o, "err_state": err_s, "ok": err_o <= TOL_OUT and err_s <= TOL_STATE}
            if entry["ok"]:
                t = hidden_launch_time(lambda: fn(**args, A_log=x["A_log"], dt_bias=x["dt_bias"], out=out))
                entry.update(t, tbps=row["bytes"] / t["gpu_s"] / 1e12, frac_ceiling=row["bytes"] / t["gpu_s"] / ceiling)
            row["impls"][name] = entry
        rows.append(row)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_Bps": ceiling,
            "floor_s": floor_s,
            "shape": {"H": H, "K": K, "V": V}, "rows": rows}


def print_table(res: dict[str, Any], sweep: bool) -> None:
    print(f"# {res['device']}, torch {res['torch']}; copy ceiling {res['ceiling_Bps'] / 1e12:.2f} TB/s; "
          f"H={H} K={K} V={V}, bf16 inputs, fp32 state; GPU time with the launch hidden "
          f"(a one-element kernel takes {res['floor_s'] * 1e6:.1f} µs this way)")
    names = ["ours-auto", "ours-fused", "ours-tiled", "fla-core"]
    print("| N | slots | copy of the same bytes µs (% ceiling) | " + " | ".join(f"{n} µs (% ceiling)" for n in names)
          + " | host µs ours / fla | ours-auto vs fla | ours-auto vs the copy |")
    print("|---" * (len(names) + 6) + "|")
    for row in res["rows"]:
        cells = []
        for name in names:
            e = row["impls"].get(name)
            if e is None:
                cells.append("n/a")
            elif not e["ok"]:
                cells.append(f"FAILED (err out {e['err_out']:.1e}, state {e['err_state']:.1e})")
            else:
                cells.append(f"{e['gpu_s'] * 1e6:.1f} ({e['frac_ceiling']:.1%})")
        ours, fla = row["impls"]["ours-auto"], row["impls"].get("fla-core")
        host = f"{ours.get('host_s', float('nan')) * 1e6:.0f} / " + (f"{fla['host_s'] * 1e6:.0f}" if fla and fla.get("ok") else "n/a")
        ratio = f"{fla['gpu_s'] / ours['gpu_s']:.2f}x" if fla and fla.get("ok") and ours.get("ok") else "n/a"
        copy_s = row["copy_same_bytes"]["gpu_s"]
        copy = f"{copy_s * 1e6:.1f} ({row['bytes'] / copy_s / res['ceiling_Bps']:.1%})"
        vs_copy = f"{copy_s / ours['gpu_s']:.1%}" if ours.get("ok") else "n/a"
        print(f"| {row['N']} | {row['slots']} | {copy} | " + " | ".join(cells) + f" | {host} | {ratio} | {vs_copy} |")
    if sweep:
        print("\nbest launch configs per N (GPU time):")
        for row in res["rows"]:
            timed = sorted((e["gpu_s"], name) for name, e in row["impls"].items() if e.get("ok"))
            print(f"  N={row['N']} {row['slots']}: " + ", ".join(f"{name} {t * 1e6:.1f}µs" for t, name in timed[:6]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", default=",".join(map(str, NS)), help="batch sizes, comma-separated")
    p.add_argument("--sweep", action="store_true", help="also time every launch config")
    p.add_argument("--slots", default=",".join(SLOT_ORDERS),
                   help="slot orders, comma-separated: ascending (the engine's), shuffled")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    orders = tuple(o.strip() for o in args.slots.split(","))
    if unknown := [o for o in orders if o not in SLOT_ORDERS]:
        p.error(f"--slots: unknown order(s) {', '.join(unknown)}; choose from {', '.join(SLOT_ORDERS)}")
    if not torch.cuda.is_available():
        print("bench/kda_decode.py needs a CUDA GPU (the kernel runs on the CPU only under TRITON_INTERPRET=1, "
              "which is for correctness, not speed)", file=sys.stderr)
        return 2
    res = run(tuple(int(n) for n in args.ns.split(",")), args.sweep, orders)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res, args.sweep)
    failed = [(r["N"], n) for r in res["rows"] for n, e in r["impls"].items() if not e["ok"] and n.startswith("ours")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
