"""What tracing costs refstack: end-to-end tokens/s through a server and engine tokens/s,
with tracing off, infra_agent.tracing on, torch.profiler on and py-spy sampling,
interleaved in one run (issue #14).

    python bench/tracer_overhead.py [--preset tiny] [--batch 8] [--prompt-len 32] [--gen-len 64]
                                    [--window-s 1.0] [--e2e-window-s 4.0] [--repeats 40] [--torch-threads 1]
                                    [--no-pyspy] [--no-e2e] [--quick] [--json [PATH]]

Goal: our tracing costs <= 2% of throughput; torch.profiler's and py-spy's costs are
reported beside it.  "Our tracing" is measured at both levels (``step``, what
``refstack serve --trace true`` records by default, and ``layer``, the timeline probe's
diagnostic level with the per-layer spans); the goal's row is the default level's.  Two
measures of each, both reported, with a verdict each:

- E2E (the goal's measure): a client's tokens/s through one ``refstack serve``, tracing
  switched on and off over HTTP between calls; torch.profiler E2E on a second server,
  started on its engine thread by ``POST /start_profile`` (``tracer_overhead_e2e``, its
  docstring).
- Engine: ``Engine.generate`` in a worker process, the strictest denominator (it leaves
  out everything a request costs besides the engine step), torch.profiler included.

Why the shape of the engine-level run:

- A worker process runs off, tracing and pyspy on one engine, so they differ only in
  what is switched on; a server per setting would add the per-process offset that
  bench/ab_power.py measures, larger than the 2% asked about.  It is a process of its
  own because py-spy samples from outside, as the timeline probe does.  torch.profiler
  runs in a second worker with its own ``off`` windows (its ratio is to those): its first
  use loads ~130k objects into the heap for good, which would tax tracing (next points).
- The engine is stepped on the worker's main thread (``Engine.generate`` without the
  loop thread): torch.profiler records only the thread that starts it, so with the
  serving loop thread it would record nothing and cost nothing.
- ``tracing``: the trace reset before the window and switched on for each tracing call,
  as a server runs with ``--trace true`` (the timeline probe's trace knob) after a
  ``/debug/trace?reset=true``.  ``torch_profiler``: CPU activities, ``record_shapes=False``.
  ``pyspy``: the timeline probe's own sampler (``PySpyDumpSampler``, back-to-back
  ``py-spy dump`` at its default ``sample_interval_s``) on the worker, tracing off.
  Reading the results out (snapshot, profiler stop) happens after the window, as the
  probe fetches spans after its window; its time is the ``post s`` column (for our
  tracing, one snapshot of both levels' events, the window they share).
- The workers import refstack's server modules and none of this script's analysis: span
  events kept in memory are objects the garbage collector walks, and each full collection
  walks the whole heap, so tracing's cost grows with the heap and a server's is the one
  that matters (``gc_objects`` in the JSON: each worker's count after its warm-up).
- A window is a fixed number of ``generate`` calls (calibrated to ``--window-s`` with
  tracing off); tokens/s = output tokens / wall.  Windows run in cycles with the order
  rotated each cycle (A B C D, B C D A, ...) so drift and position hit all alike.
- off and our two tracing levels share one window and alternate call by call (order
  rotated each round), since switching tracing on or off costs nothing: each tracing
  call is compared with the off call beside it, ~20 ms apart, so the ratio cancels all
  drift slower than that.  Whole windows a few seconds apart left a scatter of +-1.3%
  per cycle on this shared machine, the size of the effect asked about.  The off calls
  then run beside the trace the tracing calls keep, so whatever a growing trace costs
  the heap is charged to both: a whole-window pair (off, step level) each cycle checks
  that.  py-spy (a sampler started from outside, against the whole-window off) and
  torch.profiler (its own worker) keep whole windows.
- ``--torch-threads 1`` by default: this machine has 2 cores shared with other work, and
  two OpenMP threads that lose a core to a sampler or a neighbour wait at every barrier,
  which measures the oversubscription rather than the tracer (``0`` takes torch's default).
- Intervals are the project's (infra_agent.judge): tokens/s is a bootstrap CI of the
  median over cycles; a ratio vs off is one per cycle (for the paired window the median
  of its pairs of neighbouring calls, kept in ``call_ratios``; otherwise the two windows'
  tok/s, run within seconds), summarised by the median with its bootstrap CI over
  cycles (with < 10 cycles, the judge's t-interval of the geometric mean), and its
  verdict against ``ratio >= 0.98`` is the judge's ``decide``: pass/fail only when the
  whole CI is on one side.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

GOAL = 0.02  # issue #14: tracing may cost at most 2% of throughput
# The level `refstack serve --trace true` records (its --trace-level knob's default): the goal's row.
DEFAULT_LEVEL = "step"
# Each series: (where it runs: the paired window or a worker's whole window, what it runs,
# the series its ratio is to).  The paired window runs off and both tracing levels call
# by call (the module docstring); the whole-window rows are py-spy's baseline and a
# cross-check of the step level against what a long traced window retains.
SERIES = {"off": ("paired", "off", None), "tracing (layer level)": ("paired", "tracing", "off"),
          "tracing (step level)": ("paired", "tracing_step", "off"),
          "off (E2E)": ("e2e", "off", None), "tracing (layer level, E2E)": ("e2e", "tracing", "off (E2E)"),
          "tracing (step level, E2E)": ("e2e", "tracing_step", "off (E2E)"),
          "off (whole window)": ("main", "off", None),
          "tracing (step level, whole window)": ("main", "tracing_step", "off (whole window)"),
          "pyspy": ("main", "off", "off (whole window)"),
          "off (profiler worker)": ("profiler", "off", None),
          "torch_profiler": ("profiler", "torch_profiler", "off (profiler worker)"),
          "off (E2E, profiler server)": ("e2e_profiler", "off", None),
          "torch_profiler (E2E)": ("e2e_profiler", "torch_profiler", "off (E2E, profiler server)")}
# Windows whose settings take turns call by call: the engine's (one worker) and the
# server's (tracer_overhead_e2e: one server, tracing switched over HTTP).
PAIRED_WINDOWS = ("paired", "e2e")
PAIRED = {name: setting for name, (where, setting, _) in SERIES.items() if where == "paired"}
E2E = {name: setting for name, (where, setting, _) in SERIES.items() if where == "e2e"}
WINDOWS = (*PAIRED_WINDOWS, *(name for name, (where, _, _) in SERIES.items() if where not in PAIRED_WINDOWS))  # a cycle


# ---------------------------------------------------------------- worker (the measured process)

def worker(args: argparse.Namespace) -> None:
    import torch
    import uvicorn  # noqa: F401 - with the server's modules below: a server's heap (docstring)

    import refstack.server.app  # noqa: F401
    from infra_agent import tracing
    from refstack.engine import Engine, EngineConfig, SamplingParams
    from refstack.model import ByteTokenizer

    # Protocol lines go to the real stdout; anything a library prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    engine = Engine(EngineConfig(preset=args.preset, max_running=args.batch, max_batch_tokens=args.batch * args.prompt_len,
                                 prefill_chunk=args.prompt_len, torch_threads=args.torch_threads),
                    tokenizer=ByteTokenizer())
    prompts = [[(31 * b + 7 * i) % 256 for i in range(args.prompt_len)] for b in range(args.batch)]
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)

    def window(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            engine.generate(prompts, params)
        return time.perf_counter() - t0

    def switch(setting: str) -> None:
        if setting == "off":
            tracing.disable()
        else:  # "layer" (every span, the default) or "step" (no per-layer spans)
            tracing.enable(level="step" if setting == "tracing_step" else "layer")

    def paired(calls: int) -> dict[str, Any]:
        """``calls`` rounds of one generate per setting, the order rotated each round."""
        order = list(PAIRED.values())
        walls: dict[str, list[float]] = {s: [] for s in order}
        tracing.reset()
        for i in range(calls):
            k = i % len(order)
            for setting in order[k:] + order[:k]:
                switch(setting)
                t0 = time.perf_counter()
                engine.generate(prompts, params)
                walls[setting].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tracing.snapshot()  # what GET /debug/trace builds
        post = time.perf_counter() - t0
        tracing.disable()
        tracing.reset()
        return {"setting": "paired", "walls": walls, "post_s": post}

    def run(setting: str, calls: int, count: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"setting": setting}
        if setting == "paired":
            return paired(calls)
        if setting in ("tracing", "tracing_step"):
            switch(setting)
            tracing.reset()
            wall = window(calls)
            t0 = time.perf_counter()
            out["events"] = len(tracing.snapshot()["traceEvents"])  # what GET /debug/trace builds
            post = time.perf_counter() - t0
            tracing.disable()
            tracing.reset()
        elif setting == "torch_profiler":
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
            prof.start()
            wall = window(calls)
            t0 = time.perf_counter()
            prof.stop()
            post = time.perf_counter() - t0
            if count:  # events() builds Python objects, seconds for a window: warm-up only
                out["events"] = len(prof.events())
        else:  # off, and pyspy (sampled from the parent)
            wall, post = window(calls), 0.0
        return {**out, "wall_s": wall, "post_s": post, "tokens_per_s": calls * args.batch * args.gen_len / wall}

    # First-use costs (allocations, profiler init) out of the way; events per generate show
    # that each setting records the engine's work (a profiler that saw nothing would cost nothing).
    run("off", 1)
    measured = {"tracing (layer level)": "tracing", "tracing (step level)": "tracing_step"} if args.worker == "main" \
        else {"torch_profiler": "torch_profiler"}
    events = {name: run(setting, 1, count=True)["events"] for name, setting in measured.items()}
    gc.collect()  # the warm-up's garbage (the profiler's event objects) out of the heap the windows see
    calls = args.calls or max(1, round(args.window_s / statistics.median(window(1) for _ in range(3))))
    proto.write(json.dumps({"ready": True, "pid": os.getpid(), "calls": calls, "torch_threads": torch.get_num_threads(),
                            "dtype": str(engine.dtype), "native_kernels": engine.native_kernels,
                            "events_per_generate": events, "gc_objects": len(gc.get_objects())}) + "\n")
    for line in sys.stdin:
        proto.write(json.dumps(run(json.loads(line)["setting"], calls)) + "\n")


# ---------------------------------------------------------------- parent (schedules, samples, reports)

class Worker:
    def __init__(self, args: argparse.Namespace, role: str, calls: int, log: IO[str]) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--calls", str(calls), "--preset", args.preset,
               "--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
               "--window-s", str(args.window_s), "--torch-threads", str(args.torch_threads)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            tail = Path(self.log.name).read_text()[-2000:]
            raise SystemExit(f"the benchmark worker exited ({self.proc.wait()}):\n{tail}")
        return dict(json.loads(line))

    def run(self, setting: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"setting": setting}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def pyspy_unavailable(pid: int) -> str | None:
    """Why py-spy cannot sample ``pid`` here, or None: one dump, as the probe's sampler runs it."""
    exe = shutil.which("py-spy")
    if exe is None:
        return "py-spy is not on PATH (pip install py-spy, in the test extras)"
    proc = subprocess.run([exe, "dump", "--json", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                          check=False, timeout=60)
    if proc.returncode != 0:
        first = next((ln.strip() for ln in proc.stderr.splitlines() if ln.strip()), f"exit {proc.returncode}")
        return f"py-spy dump failed (ptrace refused?): {first}"
    return None


def measure(args: argparse.Namespace, log: IO[str]) -> dict[str, Any]:
    from infra_agent.probes.timeline_config import TimelineConfig
    from infra_agent.trace.sampler import PySpyDumpSampler

    interval_s = float(TimelineConfig.model_fields["sample_interval_s"].default)  # the probe's rate
    from tracer_overhead_e2e import E2EWindow

    workers: dict[str, Worker] = {}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SERIES}
    e2e: E2EWindow | None = None
    e2e_prof: E2EWindow | None = None  # a second server for torch.profiler (tracer_overhead_e2e)
    try:
        # One after the other: the second takes the first's window, so both windows do the same work.
        workers["main"] = Worker(args, "main", 0, log)
        workers["profiler"] = Worker(args, "profiler", workers["main"].hello["calls"], log)
        e2e_calls = 0
        if not args.no_e2e:
            e2e = E2EWindow(args.preset, args.batch, args.prompt_len, args.gen_len, args.torch_threads).start()
            e2e_calls = e2e.calibrate(args.e2e_window_s)
            e2e_prof = E2EWindow(args.preset, args.batch, args.prompt_len, args.gen_len, args.torch_threads).start()
            e2e_prof.calibrate(args.e2e_window_s)  # its warm-up; the windows take the first server's length
            e2e_prof.warm_profiler()
        pid = workers["main"].hello["pid"]
        reason = "skipped (--no-pyspy)" if args.no_pyspy else pyspy_unavailable(pid)
        windows = [w for w in WINDOWS if (w != "pyspy" or reason is None) and (w != "e2e" or e2e is not None)
                   and (w not in SERIES or SERIES[w][0] != "e2e_profiler" or e2e_prof is not None)]
        tokens_per_call = args.batch * args.gen_len
        with tempfile.TemporaryDirectory(prefix="tracer-overhead-") as tmp:
            for r in range(args.repeats):
                k = r % len(windows)
                for w in windows[k:] + windows[:k]:
                    if w == "pyspy" and reason is not None:
                        continue  # failed in an earlier cycle: the cycles keep going without it
                    if w in PAIRED_WINDOWS:
                        series = PAIRED if w == "paired" else E2E
                        res = workers["main"].run("paired") if w == "paired" or e2e is None else \
                            e2e.run(e2e_calls, list(series.values()))
                        for s, setting in series.items():
                            walls = res["walls"][setting]
                            runs[s].append({"setting": setting, "call_walls": walls, "wall_s": sum(walls),
                                            "post_s": 0.0 if setting == "off" else res["post_s"],
                                            "tokens_per_s": len(walls) * tokens_per_call / sum(walls)})
                        done = list(series)
                    else:
                        role, setting, _ = SERIES[w]
                        sampler = PySpyDumpSampler(pid, Path(tmp) / f"gil-{r}.jsonl", interval_s).start() \
                            if w == "pyspy" else None
                        res = e2e_prof.whole(e2e_calls, setting) if role == "e2e_profiler" and e2e_prof is not None \
                            else workers[role].run(setting)
                        if sampler is not None:
                            spy = sampler.stop()
                            res["samples"], res["sample_hz"] = sampler.samples, sampler.samples / res["wall_s"]
                            if spy.path is None:
                                reason = (spy.warning or "py-spy took no sample").removeprefix("py-spy unavailable, spans only: ")
                        runs[w].append(res)
                        done = [w]
                    for s in done:
                        print(f"  cycle {r + 1}/{args.repeats} {s:>21}: {runs[s][-1]['tokens_per_s']:9.1f} tok/s",
                              file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
        for server in (e2e, e2e_prof):
            if server is not None:
                server.close()
    unavailable = {"pyspy": reason} if reason is not None else {}
    if e2e is None:
        unavailable.update({s: "skipped (--no-e2e)" for s, (where, _, _) in SERIES.items() if where.startswith("e2e")})
    for s in unavailable:
        runs.pop(s)
    return {"workers": {k: w.hello for k, w in workers.items()}, "runs": runs, "unavailable": unavailable,
            "pyspy_unavailable": reason, "pyspy_interval_s": interval_s, "e2e_calls": e2e_calls}


def summarise(m: dict[str, Any]) -> dict[str, Any]:
    from infra_agent.judge import verdict
    from infra_agent.stats import bootstrap

    out: dict[str, Any] = {}
    for s, (_, _, base) in SERIES.items():
        if s not in m["runs"]:
            out[s] = {"available": False, "reason": f"unavailable: {m['unavailable'][s]}"}
            continue
        runs = m["runs"][s]
        vals = [r["tokens_per_s"] for r in runs]
        ci = bootstrap.bootstrap_ci(vals, stat="median")
        row: dict[str, Any] = {"available": True, "tokens_per_s": vals, "median": ci.value, "ci": [ci.low, ci.high],
                               "post_s_median": statistics.median(r["post_s"] for r in runs)}
        if "sample_hz" in runs[0]:
            row["sample_hz_median"] = statistics.median(r["sample_hz"] for r in runs)
        if base is not None:
            if SERIES[s][0] in PAIRED_WINDOWS:
                # Each call against the off call beside it (tok/s ratio = off's wall / this
                # wall); a cycle's ratio is the median of its calls'.  The interval is over
                # cycles, not calls: the calls of one window share its heap and its load.
                call_ratios = [[a / b for a, b in zip(off["call_walls"], run["call_walls"], strict=True)]
                               for off, run in zip(m["runs"][base], runs, strict=True)]
                ratios = [statistics.median(c) for c in call_ratios]
                row["call_ratios"] = [r for c in call_ratios for r in c]
                unit = "cycles, each the median of its paired calls (off and this setting alternated call by call)"
            else:
                # Both windows of cycle i ran within seconds: their ratio cancels drift slower
                # than a cycle, and the median of the ratios shrugs off a cycle another process hit.
                ratios = [b / a["tokens_per_s"] for a, b in zip(m["runs"][base], vals, strict=True)]
                unit = "cycles"
            if len(ratios) < bootstrap.SMALL_N:
                (centre, low, high), stat = bootstrap.t_interval_log(ratios), "geomean"
                how = f"95% t-interval of the geometric-mean ratio over {len(ratios)} {unit}"
            else:
                rc = bootstrap.bootstrap_ci(ratios, stat="median")
                centre, low, high, stat = rc.value, rc.low, rc.high, "median"
                how = f"95% bootstrap CI of the median ratio over {len(ratios)} {unit}"
            rci = bootstrap.RatioCI(ratio=centre, low=low, high=high, confidence=0.95, stat=stat, n_candidate=len(ratios),
                          n_baseline=len(ratios), paired=True, n_boot=0)
            v = verdict.decide(verdict.Gate("tokens_per_s", ">=", 1.0 - GOAL), rci)
            row.update({"ratios": ratios, "ratio": centre, "ratio_ci": [low, high], "interval": how,
                        "overhead": 1.0 - centre, "overhead_ci": [1.0 - high, 1.0 - low],
                        "verdict": v.outcome, "verdict_message": v.message, "more_cycles": v.more_samples})
        out[s] = row
    return out


def table(doc: dict[str, Any]) -> str:
    meta, rows = doc["meta"], doc["settings"]
    lines = [(f"# preset={meta['preset']} batch={meta['batch']} prompt_len={meta['prompt_len']} gen_len={meta['gen_len']} "
              f"dtype={meta['dtype']} native_kernels={meta['native_kernels']} torch_threads={meta['torch_threads']}"),
             (f"# window: {meta['calls_per_window']} generate calls per setting ({meta['tokens_per_window']} output "
              f"tokens; the paired window runs {len(PAIRED)}x that, the settings taking turns call by call); "
              f"E2E window: {meta['e2e_calls_per_window']} calls of {meta['batch']} concurrent completions per setting, "
              f"through one refstack serve (tracing switched over HTTP, call by call); "
              f"{meta['repeats']} interleaved cycles; py-spy: probe's PySpyDumpSampler, interval_s="
              f"{meta['pyspy_interval_s']:g}; load average at the end {meta['loadavg_1m_end']:.2f}"),
             "# events recorded per generate call: " + ", ".join(f"{k} {v}" for k, v in meta["events_per_generate"].items())
             + "; objects the GC tracks: " + ", ".join(f"{k} worker {v}" for k, v in meta["gc_objects"].items()),
             "",
             f"| setting | tok/s median [95% CI] | ratio vs off [95% CI] | overhead [95% CI] | <= {GOAL:.0%} goal | post s |",
             "|---|---|---|---|---|---|"]
    for s, r in rows.items():
        if not r["available"]:
            lines.append(f"| {s} | {r['reason']} | | | | |")
            continue
        cells = [f"{r['median']:.1f} [{r['ci'][0]:.1f}, {r['ci'][1]:.1f}]"]
        if "ratio" not in r:
            cells += ["1", "-", "-"]
        else:
            cells += [f"{r['ratio']:.4f} [{r['ratio_ci'][0]:.4f}, {r['ratio_ci'][1]:.4f}]",
                      f"**{r['overhead']:+.2%}** [{r['overhead_ci'][0]:+.2%}, {r['overhead_ci'][1]:+.2%}]",
                      r["verdict"] + (f" (~{r['more_cycles']} more cycles)" if r["verdict"] == "inconclusive"
                                      and r["more_cycles"] else "")]
        note = f"{r['post_s_median']:.3f}" + (f" ({r['sample_hz_median']:.1f} dumps/s)" if "sample_hz_median" in r else "")
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {note} |")
    lines.append("")
    for name in ("tracing (layer level)", "tracing (step level)", "tracing (layer level, E2E)", "tracing (step level, E2E)"):
        t = rows[name]
        if not t["available"]:
            continue
        lines += [f"goal ({name} overhead <= {GOAL:.0%}): {t['verdict'].upper()} - {t['verdict_message']}; {t['interval']}"]
    goal = doc.get("goal")
    if goal:
        lines.append(f"the goal's row ({DEFAULT_LEVEL}, the level `refstack serve --trace true` records): "
                     f"{goal['setting']}: {goal['outcome'].upper()}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="refstack model preset (tiny: what refstack serve and the examples run)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--window-s", type=float, default=None, help="target window length, tracing off (default 1, quick 0.25)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved cycles (default 40, quick 6)")
    ap.add_argument("--e2e-window-s", type=float, default=None,
                    help="E2E window length per setting, tracing off (default 4: HTTP adds scatter; quick: --window-s)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (0: torch's default); see the module docstring for why 1")
    ap.add_argument("--no-pyspy", action="store_true", help="leave the py-spy setting out")
    ap.add_argument("--no-e2e", action="store_true", help="leave the end-to-end window (a refstack server) out")
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 2 min): short windows, few cycles")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="write the results as JSON to PATH; without PATH, to stdout (the table then goes to stderr)")
    ap.add_argument("--worker", choices=("main", "profiler"), help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=0, help=argparse.SUPPRESS)  # a worker's window; 0: calibrate
    args = ap.parse_args()
    args.window_s = args.window_s if args.window_s is not None else (0.25 if args.quick else 1.0)
    args.repeats = args.repeats if args.repeats is not None else (6 if args.quick else 40)
    args.e2e_window_s = args.e2e_window_s if args.e2e_window_s is not None else (args.window_s if args.quick else 4.0)
    if args.worker:
        worker(args)
        return
    if args.repeats < 2:
        ap.error("--repeats must be >= 2: an interval needs repeated cycles")
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", prefix="tracer-overhead-worker-", suffix=".log") as log:
        m = measure(args, log)
    hello = m["workers"]["main"]
    doc = {"meta": {"preset": args.preset, "batch": args.batch, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                    "repeats": args.repeats, "window_s": args.window_s, "calls_per_window": hello["calls"],
                    "tokens_per_window": hello["calls"] * args.batch * args.gen_len, "dtype": hello["dtype"],
                    "e2e_calls_per_window": m["e2e_calls"], "e2e_window_s": args.e2e_window_s,
                    "native_kernels": hello["native_kernels"], "torch_threads": hello["torch_threads"],
                    "pyspy_interval_s": m["pyspy_interval_s"], "goal_max_overhead": GOAL, "quick": args.quick,
                    "events_per_generate": {k: v for w in m["workers"].values() for k, v in w["events_per_generate"].items()},
                    "gc_objects": {k: w["gc_objects"] for k, w in m["workers"].items()},
                    "command": " ".join(["python", "bench/tracer_overhead.py", *sys.argv[1:]]),
                    "loadavg_1m_end": os.getloadavg()[0]},  # other work on the machine, for the reader
           "settings": summarise(m)}
    rows = doc["settings"]
    # The measure is E2E; without the E2E window (--no-e2e) the engine's rows stand in.
    # The goal is "our tracing" as `refstack serve --trace true` runs it: its default level.
    # The other level's verdicts stay beside it (layer: the timeline probe's diagnostic level).
    e2e = " E2E" if rows["tracing (layer level, E2E)"]["available"] else ""
    row = {level: f"tracing ({level} level{',' + e2e if e2e else ''})" for level in ("layer", "step")}
    other = "layer" if DEFAULT_LEVEL == "step" else "step"
    doc["goal"] = {"setting": row[DEFAULT_LEVEL], "level": DEFAULT_LEVEL, "max_overhead": GOAL,
                   "outcome": rows[row[DEFAULT_LEVEL]]["verdict"],
                   f"{other}_level_outcome": rows[row[other]]["verdict"],
                   "engine_outcome": rows[f"tracing ({DEFAULT_LEVEL} level)"]["verdict"],
                   f"engine_{other}_level_outcome": rows[f"tracing ({other} level)"]["verdict"]}
    doc["meta"]["elapsed_s"] = time.perf_counter() - t0
    text = table(doc)
    if args.json == "-":
        print(text, file=sys.stderr)
        print(json.dumps(doc, indent=1))
    else:
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
