"""What the Ray executor adds to each experiment, against the local executor on the same workspace.

    python bench/ray_overhead.py [--repeats 12] [--address HEAD:6379] [--workspace WS --scenario chat] [--json]

Each experiment is the same job for both executors: the workspace's checks (by default a
fresh workspace whose one check is a ``command`` probe running ``python -c pass`` in a
worker subprocess, so the job itself is small and the difference is the executor's own
cost), or with ``--workspace``/``--scenario`` one serving window of that workspace's target
as well.  The check cache is emptied before every experiment, so each one runs its checks.

**Protocol.**  One warm-up experiment on each executor first (Ray's first task starts a
worker process and the run's progress queue: reported apart as "cold").  Then
``--repeats`` pairs, the order alternating (local then Ray, Ray then local, ...) so that a
drift of the machine's load falls on both; each pair gives the difference of the walls
(Ray - local), summarised by its mean with a 95% t-interval, and their ratio by the
geometric mean.  The Ray side's wall is split by the executor's own timing
(``meta["executor"]["timing"]``, ray_nodes.py): packing the workspace (ship), submission to
the task's start on its node (schedule: placement, the spec's transfer, the worker), the
task itself, and its end to the result in the driver (return).

Without ``--address`` the Ray side is a local instance (``ray.init(num_cpus=2)``), on the
same machine as the local side: its figure is the executor's own overhead, without a
network between driver and node.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def make_workspace(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    spec = {"name": "ray-overhead", "target": {"kind": "endpoint", "url": "http://127.0.0.1:9"},
            "knobs": {}, "checks": [{"name": "unit", "probe": "command", "config": {"command": [sys.executable, "-c", "pass"]}}]}
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {"GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@localhost", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@localhost", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(root)}
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *cmd], cwd=root, env=env, check=True, capture_output=True)
    return root


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    from scipy import stats

    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    half = stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def one(executor: Any, seq: int, scenarios: list[str], checks: list[str]) -> tuple[float, dict[str, Any]]:
    from infra_agent.records import Experiment, Hypothesis

    executor._check_cache.clear()  # every experiment runs its checks (no reuse across repeats)
    exp = Experiment(id=f"e{seq}", run_id=executor.run_id, seq=seq, role="experiment", parent="e0",
                     hypothesis=Hypothesis(statement="overhead", metric="-", direction="higher"), knobs={})
    t0 = time.perf_counter()
    ex = executor.measure(exp, scenarios, 1, checks)
    wall = time.perf_counter() - t0
    if ex.status != "done":
        raise SystemExit(f"{executor.name} experiment e{seq} failed: {ex.error}")
    fbs = list(ex.checks.values()) + [fb for runs in ex.candidate.values() for fb in runs]
    return wall, (fbs[0].meta.get("executor", {}).get("timing", {}) if fbs else {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--address", default=None, help="a Ray cluster to join (default: a local instance, 2 CPUs)")
    ap.add_argument("--workspace", type=Path, default=None, help="measure this workspace's checks (default: a fresh one)")
    ap.add_argument("--scenario", action="append", default=[], help="also one serving window of this scenario")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import ray

    from infra_agent.agent.executors.local import LocalExecutor
    from infra_agent.agent.executors.ray_executor import RayExecutor
    from infra_agent.workspace import load_workspace

    tmp = tempfile.TemporaryDirectory(prefix="ray-overhead-")
    ws = load_workspace(args.workspace or make_workspace(Path(tmp.name) / "ws"))
    checks = [c.name for c in ws.checks]
    if args.address is None:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    run_id = time.strftime("bench-%Y%m%d-%H%M%S")
    local = LocalExecutor(ws, run_id + "-local")
    remote = RayExecutor(ws, run_id + "-ray", address=args.address)
    seq = 0
    cold: dict[str, float] = {}
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    parts: list[dict[str, float]] = []
    try:
        for name, ex in (("local", local), ("ray", remote)):
            seq += 1
            cold[name] = one(ex, seq, args.scenario, checks)[0]
        for i in range(args.repeats):
            order = [("local", local), ("ray", remote)] if i % 2 == 0 else [("ray", remote), ("local", local)]
            for name, ex in order:
                seq += 1
                wall, timing = one(ex, seq, args.scenario, checks)
                walls[name].append(wall)
                if name == "ray":
                    parts.append(timing)
                print(f"  pair {i + 1}/{args.repeats} {name}: {wall:.3f} s", file=sys.stderr)
    finally:
        local.cleanup()
        remote.cleanup()
        ray.shutdown()
        tmp.cleanup()
    diffs = [r - loc for r, loc in zip(walls["ray"], walls["local"])]
    ratios = [r / loc for r, loc in zip(walls["ray"], walls["local"])]
    out = {
        "repeats": args.repeats, "address": args.address, "checks": checks, "scenarios": args.scenario,
        "cold_s": cold, "local_s": t_interval(walls["local"]), "ray_s": t_interval(walls["ray"]),
        "ray_minus_local_s": t_interval(diffs), "ratio_geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
        "ray_parts_median_s": {k: statistics.median(p[k] for p in parts if k in p)
                               for k in ("pack_s", "to_start_s", "run_s", "back_s", "overhead_s") if any(k in p for p in parts)},
        "shipped_bytes": parts[0].get("shipped_bytes") if parts else None,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    fmt = lambda t: f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"  # noqa: E731
    print(f"per experiment, {args.repeats} interleaved pairs (95% t-intervals); cold: local {cold['local']:.2f} s, "
          f"ray {cold['ray']:.2f} s")
    print("| what | seconds |\n|---|---|")
    print(f"| local executor, wall | {fmt(out['local_s'])} |")
    print(f"| ray executor, wall | {fmt(out['ray_s'])} |")
    print(f"| ray - local (paired) | {fmt(out['ray_minus_local_s'])} |")
    print(f"| ray / local (geometric mean of pair ratios) | {out['ratio_geomean']:.2f}x |")
    for k, v in out["ray_parts_median_s"].items():
        print(f"| ray: {k} (median) | {v:.3f} |")
    print(f"| ray: workspace shipped | {out['shipped_bytes'] or 0:.0f} bytes |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
