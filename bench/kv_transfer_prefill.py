"""Case study B's criterion: prefill throughput with ``kv_transfer`` on vs off.

    python bench/kv_transfer_prefill.py [--preset small] [--requests 8] [--prompt-len 480]
        [--pairs 6] [--set knob=value ...] [--json out.json]

Starts two disaggregated servers with the same knobs (``--set``), one with
``--kv-transfer false`` (A, the baseline: no transfer thread) and one with ``true``
(B), and sends both the same prefill-heavy burst, alternating A B B A ...
(``infra_agent.serving.interleave``): ``--requests`` streamed completions of
``--prompt-len`` seeded random token ids each, ``max_tokens`` 2 (so every request is
handed off to the decode worker).  A run's prefill throughput is the burst's prompt
tokens divided by the time from sending it to the last first token.  One warm-up
burst per server is not counted.  Prints each side's median, the ratio B / A with a
paired bootstrap 95% interval (``infra_agent.stats.bootstrap``), and whether it meets
the criterion (ratio >= 0.95).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from infra_agent.stats.bootstrap import bootstrap_ratio

_URL = re.compile(r"refstack serving on (http://\S+)")


def start_server(args: list[str], log_path: str) -> tuple[str, subprocess.Popen[bytes]]:
    cmd = [sys.executable, "-m", "refstack.cli", "serve", "--port", "0", *args]
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as fh:
            m = _URL.search(fh.read())
        if m:
            return m.group(1), proc
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {Path(log_path).read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("server did not start")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def engine_burst(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """``burst`` without HTTP: straight into a ``DisaggEngine`` (``--in-process``)."""
    from refstack.engine import SamplingParams

    firsts: list[float] = []
    finished: list[str | None] = []
    done = threading.Event()
    lock = threading.Lock()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()

    def sink(out: Any) -> None:
        with lock:
            if out.token_ids and out.completion_tokens == len(out.token_ids):
                firsts.append(time.perf_counter() - start)
            if out.finished:
                finished.append(out.finish_reason)
                if len(finished) == len(prompts):
                    done.set()

    for p in prompts:
        engine.add_request(p, params, sink)
    done.wait(600)
    if len(firsts) != len(prompts) or any(r != "length" for r in finished):
        return {"ok": False, "error": finished}
    return {"ok": True, "prefill_tok_s": sum(map(len, prompts)) / max(firsts), "last_first_token_s": max(firsts)}


def burst(url: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Send every prompt at once; the prompt tokens per second until the last first token."""
    import httpx

    firsts: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    # One client for the burst: a client per request (``httpx.stream``) builds an SSL
    # context each time, ~30 ms of the 2 shared cores per request, charged to the server.
    client = httpx.Client(timeout=600, trust_env=False,
                          limits=httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts)))
    start = time.perf_counter()

    def one(prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                seen = False
                for line in r.iter_lines():
                    if line.startswith("data: {") and not seen:
                        seen = True
                        with lock:
                            firsts.append(time.perf_counter() - start)
        except httpx.HTTPError as exc:
            with lock:
                errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    if errors or len(firsts) != len(prompts):
        return {"ok": False, "error": errors[:1]}
    tokens = sum(len(p) for p in prompts)
    return {"ok": True, "prefill_tok_s": tokens / max(firsts), "last_first_token_s": max(firsts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="a knob for both servers")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--in-process", action="store_true",
                    help="drive two DisaggEngines in this process instead of two HTTP servers (no web stack needed)")
    a = ap.parse_args(argv)
    knobs: list[str] = ["--preset", a.preset]
    for item in a.set:
        name, _, value = item.partition("=")
        knobs += ["--" + name.replace("_", "-"), value]
    rng = random.Random(0)
    prompts = [[256] + [rng.randrange(0, 256) for _ in range(a.prompt_len - 1)] for _ in range(a.requests)]
    def report(side: str, i: int, r: dict[str, Any]) -> None:
        print(f"  pair {i} {side}: {r.get('prefill_tok_s', 0):.0f} tok/s", flush=True)

    if a.in_process:
        ra, rb = _in_process(a, knobs, prompts, report)
    else:
        from infra_agent.serving.interleave import interleave

        servers = {}
        try:
            for side, transfer in (("a", "false"), ("b", "true")):
                servers[side] = start_server([*knobs, "--disagg", "true", "--kv-transfer", transfer],
                                             os.path.join(a.log_dir, f"prefill-bench-{side}.log"))
            for url, _ in servers.values():
                burst(url, prompts)  # warm-up
            runs = interleave(lambda: burst(servers["a"][0], prompts), lambda: burst(servers["b"][0], prompts),
                              a.pairs, order="abba", on_run=report)
        finally:
            for _, proc in servers.values():
                stop_server(proc)
        ra, rb = runs.complete_pairs()
    xa = [r["prefill_tok_s"] for r in ra]
    xb = [r["prefill_tok_s"] for r in rb]
    ci = bootstrap_ratio(xb, xa, paired=True)
    verdict = "meets" if ci.ratio >= 0.95 else "FAILS"
    print(f"knobs: {' '.join(knobs)}")
    print(f"prefill tok/s  kv_transfer=off: median {statistics.median(xa):.0f}  on: median {statistics.median(xb):.0f}")
    print(f"on/off = {ci.ratio:.3f}  (95% CI {ci.low:.3f}-{ci.high:.3f}, {len(xa)} pairs)  {verdict} >= 0.95")
    if a.json_path:
        with open(a.json_path, "w") as fh:
            json.dump({"knobs": knobs, "off": xa, "on": xb, "ratio": ci.ratio, "low": ci.low, "high": ci.high}, fh)
    return 0


def _in_process(a: argparse.Namespace, knobs: list[str], prompts: list[list[int]],
                report: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The same A B B A alternation as ``interleave`` over two DisaggEngines (its module
    needs the HTTP client; this mode runs where only torch is installed)."""
    from refstack.disagg.frontend import DisaggEngine
    from refstack.knobs import engine_config, parse_knobs

    raw = {knobs[i][2:].replace("-", "_"): knobs[i + 1] for i in range(0, len(knobs), 2)}
    engines = {}
    try:
        for side, transfer in (("a", "false"), ("b", "true")):
            engines[side] = DisaggEngine(engine_config(parse_knobs({**raw, "kv_transfer": transfer})))
            engines[side].start()
        for e in engines.values():
            engine_burst(e, prompts)  # warm-up
        out: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        for i in range(a.pairs):
            for side in ("b", "a") if i % 2 else ("a", "b"):
                r = engine_burst(engines[side], prompts)
                out[side].append(r)
                report(side, i, r)
    finally:
        for e in engines.values():
            e.stop()
    keep = [i for i in range(a.pairs) if out["a"][i]["ok"] and out["b"][i]["ok"]]
    return [out["a"][i] for i in keep], [out["b"][i] for i in keep]


if __name__ == "__main__":
    sys.exit(main())
