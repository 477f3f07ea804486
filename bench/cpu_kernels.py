"""refstack's native CPU kernels against MKL (through torch) and against the memory's read bandwidth.

    python bench/cpu_kernels.py [--repeats 7] [--rows 1 2 4 8 16 32 64] [--tokens 1 8 32 128] [--pool-mib 256]
                                [--json out.json]

Part 1, GEMM: ``x [M, K] @ W`` for the ``small`` preset's weight shapes, three ways:
``F.linear`` (MKL sgemm, what a plain torch model such as HF's Llama runs),
``matmul_rows`` (refstack's torch path) and the packed native kernel.  Decode streams
every weight from DRAM once per step, so the weights rotate through a pool several
times the L3 size: every call reads a cold weight.  The physical limit printed beside
it is the pool's read bandwidth (``sum`` over the same bytes, measured in the same run).

Part 2, MoE experts: one layer's SwiGLU expert pairs for T routed tokens (top-2 of 8),
native (one call, all experts) against torch's two layouts (per-expert GEMMs on exactly
each expert's rows; one padded batched GEMM pair), each on its own pool of layers;
and the bf16 native kernel (``dtype=bfloat16``) on the same routing.

Part 3, bf16 GEMM (``dtype=bfloat16``): the native bf16 kernel against torch's bf16
``F.linear`` (weight and input in bf16, what a bf16 HF model runs) and against the
native fp32 kernel on the same shapes; the bf16 pool holds as many weights in half
the bytes, and the read bandwidth is measured over it.

Timings are interleaved: each repeat runs every variant once, in an order rotated per
repeat; ratios are of means with a 95% paired-bootstrap interval over the repeats.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

# bench/ is the script's directory: the same paired bootstrap as bench/engine_throughput.py
from engine_throughput import ratio_ci

from refstack.kernels import cpu_kernels, cpu_moe
from refstack.model import HybridConfig
from refstack.model.layers import matmul_rows
from refstack.model.moe import swiglu_experts

POOL_MIB = 256  # default pool: 8x a 32 MiB L3, so every weight is cold when its turn comes


def interleaved(variants: dict[str, Callable[[], None]], calls: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per repeat; ``variant()`` makes ``calls`` calls."""
    names = list(variants)
    for fn in variants.values():  # warm-up: first-touch pages, lazy inits
        fn()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            out[name].append((time.perf_counter() - t0) / calls)
    return out


def read_bandwidth(pool: list[torch.Tensor], repeats: int) -> float:
    """Bytes per second of ``sum`` over the pool (the same bytes the GEMMs stream)."""
    nbytes = sum(w.numel() * 4 for w in pool)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in pool:
            w.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def gemm_table(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int, pool_bytes: int) -> list[dict[str, object]]:
    print("| weight (K x N) | M | MKL F.linear us | matmul_rows us | native us | native / MKL speed [95% CI] "
          "| native GB/s | % of read bandwidth | native GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    records = []
    for label, (k, n) in shapes.items():
        copies = max(4, pool_bytes // (k * n * 4))
        gen = torch.Generator().manual_seed(k * 7919 + n)
        w_out_in = [torch.randn(n, k, generator=gen) * k**-0.5 for _ in range(copies)]
        packed = [cpu_kernels.pack(w.t()) for w in w_out_in]
        bandwidth = read_bandwidth(w_out_in, 3)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            samples = interleaved({
                "mkl": lambda x=x, ws=w_out_in: [F.linear(x, w) for w in ws] and None,
                "rows": lambda x=x, ws=w_out_in: [matmul_rows(x, w.t()) for w in ws] and None,
                "native": lambda x=x, ps=packed, n=n: [cpu_kernels.gemm(x, p, n) for p in ps] and None,
            }, copies, repeats)
            med = {name: statistics.median(s) for name, s in samples.items()}
            speed, lo, hi = ratio_ci(samples["mkl"], samples["native"])
            gbs = k * n * 4 / med["native"] / 1e9
            rec = {"weight": label, "k": k, "n": n, "m": m, "us": {s: v * 1e6 for s, v in med.items()},
                   "native_over_mkl": [speed, lo, hi], "native_gbs": gbs, "read_gbs": bandwidth / 1e9,
                   "native_gflops": 2 * m * k * n / med["native"] / 1e9}
            records.append(rec)
            print(f"| {label} ({k} x {n}) | {m} | {med['mkl'] * 1e6:.1f} | {med['rows'] * 1e6:.1f} | {med['native'] * 1e6:.1f} "
                  f"| **{speed:.2f}x** [{lo:.2f}, {hi:.2f}] | {gbs:.1f} | {100 * gbs * 1e9 / bandwidth:.0f}% "
                  f"| {rec['native_gflops']:.0f} |", flush=True)
    return records


def gemm_bf16_table(shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int,
                    pool_bytes: int) -> list[dict[str, object]]:
    bf16 = torch.bfloat16
    print("\n| weight (K x N) | M | torch bf16 F.linear us | native fp32 us | native bf16 us "
          "| bf16 native / torch bf16 [95% CI] | bf16 / fp32 native [95% CI] | bf16 GB/s | % of read bandwidth | GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    records = []
    for label, (k, n) in shapes.items():
        copies = max(4, pool_bytes // (k * n * 2))  # as many bf16 bytes as Part 1's fp32 pool
        gen = torch.Generator().manual_seed(k * 7919 + n)
        w_fp32 = [torch.randn(n, k, generator=gen) * k**-0.5 for _ in range(copies)]
        w_bf16 = [w.to(bf16) for w in w_fp32]
        packed = [cpu_kernels.pack(w.t(), bf16) for w in w_fp32]
        packed_fp32 = [cpu_kernels.pack(w.t()) for w in w_fp32[: max(4, copies // 2)]]  # same fp32 bytes as the bf16 pool
        # The same bytes read as fp32 words (K is even here): sum's speed, whatever the values.
        bandwidth = read_bandwidth([w.view(torch.float32) for w in w_bf16], 3)
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            xb = x.to(bf16)
            samples = interleaved({
                "torch_bf16": lambda xb=xb, ws=w_bf16: [F.linear(xb, w) for w in ws] and None,
                "fp32": lambda x=x, ps=packed_fp32, n=n, c=copies: [cpu_kernels.gemm(x, ps[i % len(ps)], n)
                                                                    for i in range(c)] and None,
                "bf16": lambda x=x, ps=packed, n=n: [cpu_kernels.gemm(x, p, n) for p in ps] and None,
            }, copies, repeats)
            med = {name: statistics.median(v) for name, v in samples.items()}
            vs_torch = ratio_ci(samples["torch_bf16"], samples["bf16"])
            vs_fp32 = ratio_ci(samples["fp32"], samples["bf16"])
            gbs = k * n * 2 / med["bf16"] / 1e9
            rec = {"weight": label, "k": k, "n": n, "m": m, "us": {v: t * 1e6 for v, t in med.items()},
                   "bf16_over_torch_bf16": list(vs_torch), "bf16_over_fp32": list(vs_fp32), "bf16_gbs": gbs,
                   "read_gbs": bandwidth / 1e9, "gflops": 2 * m * k * n / med["bf16"] / 1e9}
            records.append(rec)
            print(f"| {label} ({k} x {n}) | {m} | {med['torch_bf16'] * 1e6:.1f} | {med['fp32'] * 1e6:.1f} "
                  f"| {med['bf16'] * 1e6:.1f} | **{vs_torch[0]:.2f}x** [{vs_torch[1]:.2f}, {vs_torch[2]:.2f}] "
                  f"| **{vs_fp32[0]:.2f}x** [{vs_fp32[1]:.2f}, {vs_fp32[2]:.2f}] | {gbs:.1f} "
                  f"| {100 * gbs * 1e9 / bandwidth:.0f}% | {rec['gflops']:.0f} |", flush=True)
    return records


def moe_table(cfg: HybridConfig, tokens: list[int], repeats: int, pool_bytes: int) -> list[dict[str, object]]:
    E, D, inner, k = cfg.num_experts, cfg.hidden_size, cfg.expert_hidden_size, cfg.num_experts_per_tok
    layer_bytes = E * 3 * D * inner * 4
    layers = max(4, pool_bytes // layer_bytes)
    gen = torch.Generator().manual_seed(5)
    w_gate_up = [torch.randn(E, D, 2 * inner, generator=gen) * D**-0.5 for _ in range(layers)]
    w_down = [torch.randn(E, inner, D, generator=gen) * inner**-0.5 for _ in range(layers)]
    packed = [(cpu_kernels.pack_gate_up(a), cpu_kernels.pack_down(b)) for a, b in zip(w_gate_up, w_down)]
    bf16 = torch.bfloat16
    packed_bf16 = [(cpu_kernels.pack_gate_up(a, bf16), cpu_kernels.pack_down(b, bf16)) for a, b in zip(w_gate_up, w_down)]
    print(f"\n| tokens (top-{k} of {E}) | busiest expert rows | torch grouped us | torch padded us | native us "
          "| native / best torch speed [95% CI] | native GB/s | native bf16 us | bf16 / fp32 native speed [95% CI] |")
    print("|---|---|---|---|---|---|---|---|---|")
    records = []
    for t in tokens:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)])
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        rows = torch.randn(t * k, D, generator=gen)
        cap = max(counts)
        padded = torch.zeros(E, cap, D)
        start = 0
        for e, c in enumerate(counts):
            padded[e, :c] = rows[start : start + c]
            start += c
        samples = interleaved({
            "grouped": lambda rows=rows, counts=counts: [swiglu_experts(rows, counts, a, b) for a, b in zip(w_gate_up, w_down)]
            and None,
            "padded": lambda padded=padded, counts=counts: [swiglu_experts(padded, counts, a, b)
                                                            for a, b in zip(w_gate_up, w_down)] and None,
            "native": lambda rows=rows, counts=counts: [cpu_moe.moe_experts(rows, counts, a, b) for a, b in packed]
            and None,
            "native_bf16": lambda rows=rows, counts=counts: [cpu_moe.moe_experts(rows, counts, a, b) for a, b in packed_bf16]
            and None,
        }, layers, repeats)
        med = {name: statistics.median(s) for name, s in samples.items()}
        best = "grouped" if med["grouped"] <= med["padded"] else "padded"
        speed, lo, hi = ratio_ci(samples[best], samples["native"])
        active = sum(c > 0 for c in counts)
        gbs = active * 3 * D * inner * 4 / med["native"] / 1e9
        b_speed, b_lo, b_hi = ratio_ci(samples["native"], samples["native_bf16"])
        records.append({"tokens": t, "counts": counts, "us": {s: v * 1e6 for s, v in med.items()},
                        "native_over_best_torch": [speed, lo, hi], "best_torch": best, "native_gbs": gbs,
                        "bf16_over_fp32_native": [b_speed, b_lo, b_hi]})
        print(f"| {t} | {cap} | {med['grouped'] * 1e6:.0f} | {med['padded'] * 1e6:.0f} | {med['native'] * 1e6:.0f} "
              f"| **{speed:.2f}x** vs {best} [{lo:.2f}, {hi:.2f}] | {gbs:.1f} | {med['native_bf16'] * 1e6:.0f} "
              f"| **{b_speed:.2f}x** [{b_lo:.2f}, {b_hi:.2f}] |", flush=True)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--pool-mib", type=int, default=POOL_MIB,
                    help="weights rotate through this many MiB (default 8x the L3: cold; a few MiB: hot)")
    ap.add_argument("--json", dest="json_path", help="also write the records here")
    args = ap.parse_args()
    reason = cpu_kernels.unavailable_reason()
    if reason:
        raise SystemExit(f"native kernels unavailable: {reason}")
    cfg = HybridConfig.preset(args.preset)
    D, inner = cfg.hidden_size, cfg.expert_hidden_size
    H, K, V = cfg.kda_num_heads, cfg.kda_head_k_dim, cfg.kda_head_v_dim
    # KDA's fused input projection: q|k, v, beta, and the two rank-V bottlenecks (KDALayer.split_sizes).
    shapes = {"expert gate|up": (D, 2 * inner), "expert down": (inner, D), "KDA in_proj": (D, 2 * H * K + H * V + H + 2 * V)}
    print(f"# preset={args.preset} torch {torch.__version__} threads={torch.get_num_threads()} "
          f"cpu={platform.processor() or platform.machine()} repeats={args.repeats} weight pool {args.pool_mib} MiB\n")
    pool = args.pool_mib << 20
    records = {"gemm": gemm_table(shapes, args.rows, args.repeats, pool),
               "moe": moe_table(cfg, args.tokens, args.repeats, pool),
               "gemm_bf16": gemm_bf16_table(shapes, args.rows, args.repeats, pool)}
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({"args": vars(args), "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
