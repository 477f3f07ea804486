"""What the judge's clock costs a CPU kernel timing: the same kernel timed in the lab's
process (``time_cpu``, what ``bench`` did before the judge moved out) and from outside
the candidate's worker (``lab/judge_clock.py``: batches of >= 5 ms, one round trip
each), interleaved in one run.

    python bench/judge_clock.py [--repeats 7] [--budget-s 0.3] [--json [PATH]]

Kernels: single-threaded Python loops of ~10 us, ~100 us and ~1 ms per call (no thread
pool to contend with), and a 256x256x256 fp32 GEMM (torch's threads).  Each repeat times
every kernel both ways, the order alternating per repeat; a row's ratio is the median of
the per-repeat ratios (judge / in-process) with a 95% bootstrap interval.  The physical
limit is 1.0: the judge's clock adds one socket round trip per batch, so the ratio
should exceed 1 by about (round trip / 5 ms).  The load average before and after is
printed with the table: figures from a busy machine are not figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from infra_agent.lab.loader import load_specs
from infra_agent.lab.microbench import bench_spec
from infra_agent.lab.timing import time_cpu

SPEC = '''
import torch
from infra_agent.lab.spec import KernelSpec, Tolerance
from kernels_jc import KERNELS

SHAPE = {"N": SIZE}


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(shape["N"], shape["N"], generator=g), "b": torch.randn(shape["N"], shape["N"], generator=g)}


def reference(a, b):
    return a.double() @ b.double()


SPEC = KernelSpec(name="NAME", kernel=KERNELS["NAME"], reference=reference, inputs=inputs, shapes=[SHAPE],
                  precisions=("fp32",), tolerances={"fp32": Tolerance(rel_fro=1e-4)}, seeds=[1])
'''
KERNELS = '''
def _loop(n):
    def kernel(a, b, *, precision="fp32"):
        s = 0
        for i in range(n):
            s += i
        return a @ b
    return kernel


def gemm(a, b, *, precision="fp32"):
    return a @ b


KERNELS = {"loop_10us": _loop(200), "loop_100us": _loop(2000), "loop_1ms": _loop(20000), "gemm_256": gemm}
'''
SIZES = {"loop_10us": 8, "loop_100us": 8, "loop_1ms": 8, "gemm_256": 256}


def _specs(root: Path) -> dict[str, Any]:
    (root / "kernels_jc.py").write_text(KERNELS)
    out = {}
    for name, size in SIZES.items():
        path = root / f"{name}.py"
        path.write_text(SPEC.replace("NAME", name).replace("SIZE", str(size)))
        out[name] = load_specs(path)[0]
    return out


def _in_process(spec: Any, budget_s: float) -> float:
    inputs = spec.inputs(spec.shapes[0], torch.float32, 1, "cpu")
    return time_cpu(lambda: spec.kernel(**inputs, precision="fp32"), budget_s=budget_s).median_s


def _by_judge(spec: Any, budget_s: float) -> float:
    report = bench_spec(spec, device="cpu", n_seeds=1, budget_s=budget_s, timeout_s=120)
    (entry,) = [e for e in report.entries if e.timing is not None]
    return entry.timing.median_s


def _ci(ratios: list[float]) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    arr = np.asarray(ratios)
    boots = np.median(rng.choice(arr, size=(4000, arr.size), replace=True), axis=1)
    return float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=0.3)
    ap.add_argument("--json", nargs="?", const="-", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows: dict[str, dict[str, list[float]]] = {n: {"here": [], "judge": []} for n in SIZES}
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, tmp)  # the spec files import the kernels module beside them
        specs = _specs(Path(tmp))
        order = list(SIZES)
        for r in range(args.repeats):
            random.Random(r).shuffle(order)
            for name in order:
                ways = [("here", _in_process), ("judge", _by_judge)]
                for way, fn in (ways if r % 2 == 0 else ways[::-1]):
                    rows[name][way].append(fn(specs[name], args.budget_s))
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    load_after = os.getloadavg()
    result = []
    for name, got in rows.items():
        ratios = [j / h for j, h in zip(got["judge"], got["here"], strict=True)]
        lo, hi = _ci(ratios)
        result.append({"kernel": name, "in_process_us": statistics.median(got["here"]) * 1e6,
                       "judge_us": statistics.median(got["judge"]) * 1e6, "ratio": statistics.median(ratios),
                       "ci": [lo, hi], "repeats": args.repeats})
    meta = {"load_before": load_before, "load_after": load_after, "cpus": os.cpu_count(), "torch": torch.__version__}
    if args.json is not None:
        text = json.dumps({"rows": result, **meta}, indent=2)
        Path(args.json).write_text(text) if args.json != "-" else print(text)
        return
    table = Table(title="CPU kernel timing: the judge's clock vs the lab's process (median of per-repeat ratios)")
    for col in ("kernel", "in-process us", "judge's clock us", "judge / in-process", "95% CI"):
        table.add_column(col, justify="right" if col != "kernel" else "left")
    for row in result:
        table.add_row(row["kernel"], f"{row['in_process_us']:.1f}", f"{row['judge_us']:.1f}", f"{row['ratio']:.3f}",
                      f"[{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]")
    console = Console()
    console.print(table)
    console.print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; {meta['cpus']} CPUs; "
                  f"torch {meta['torch']}; {args.repeats} repeats, budget {args.budget_s} s per timing")


if __name__ == "__main__":
    main()
