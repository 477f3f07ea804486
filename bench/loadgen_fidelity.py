"""Our load generator against peers (NVIDIA aiperf, vLLM's guidellm) on the same refstack server.

    python bench/loadgen_fidelity.py [--aiperf PATH] [--guidellm PATH] [--reps 3] [--small 60] [--large 240] [--request-rate R [--arrival constant]]
                                     [--server-cpus 0 --client-cpus 1] [--server-step-delay-ms 10]

All clients drive the same server with the same load (concurrency, prompt and output
lengths, ignore_eos, temperature 1), interleaved rep by rep with the order rotated each
rep, each as its own process.  For every run we also diff the server's own Prometheus
histograms, the reference that no client overhead can touch.  One table per peer.

- Agreement: medians over reps of median TTFT, median TPOT (aiperf's
  ``inter_token_latency`` and guidellm's ``inter_token_latency_ms`` are both
  (e2e − TTFT)/(tokens − 1) per request, vLLM's TPOT) and output throughput, at the
  large run size; the goal is |ours/peer − 1| <= 5%.
- CPU per streamed token: child-process CPU (user+sys, ``RUSAGE_CHILDREN``, which
  covers a peer's worker processes) of a large run minus that of a small run, divided
  by the difference in streamed tokens, so interpreter and framework start-up cancel.

The peers run fully offline: their tokenizer is a byte-level one (like refstack's)
built here with the ``tokenizers`` package into a private Hugging Face cache folder,
and ``HF_HUB_OFFLINE=1`` keeps them off the network.  aiperf takes output token counts
from the server's ``usage`` (``--use-server-token-count``); guidellm reads ``usage``
from the stream by itself.  ``--server-step-delay-ms`` makes the engine sleep inside
every step, like a server whose engine waits on a GPU: the host's cores are then left
to the clients, which on a 2-core machine is the only way a heavy client does not
slow the very server it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from infra_agent.serving.prom import parse_histogram_totals, phase_deltas
from infra_agent.target import ServerProcess
from infra_agent.workspace.models import ServerTargetSpec


def server_spec(pin: str | None, step_delay_ms: float) -> ServerTargetSpec:
    # With --pin the server gets its own core(s) and the clients the rest, so a
    # client's CPU appetite cannot slow the server it is measuring (on a 2-core box
    # that effect was larger than the 5% agreement goal).
    prefix = ["taskset", "-c", pin] if pin else []
    return ServerTargetSpec(
        kind="server",
        command=[*prefix, sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny", "--port", "{port}",
                 "--torch-threads", "{threads}", "--step-delay-ms", str(step_delay_ms)],
        ready_url="/health", metrics_url="/metrics", ready_timeout_s=180,
    )


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd

# Builds a byte-level fast tokenizer (256 byte symbols, no merges) in HF cache layout.
_MAKE_TOKENIZER = r"""
import json, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from tokenizers.pre_tokenizers import ByteLevel
snap = os.path.join(sys.argv[1], "models--local--bytetok", "snapshots", "0" * 40)
os.makedirs(snap, exist_ok=True)
vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
vocab["<eos>"] = len(vocab)
tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
tok.decoder = decoders.ByteLevel()
tok.save(os.path.join(snap, "tokenizer.json"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "model_max_length": 4096},
          open(os.path.join(snap, "tokenizer_config.json"), "w"))
os.makedirs(os.path.join(sys.argv[1], "models--local--bytetok", "refs"), exist_ok=True)
open(os.path.join(sys.argv[1], "models--local--bytetok", "refs", "main"), "w").write("0" * 40)
"""


def child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def scrape(url: str) -> dict[str, float]:
    return parse_histogram_totals(httpx.get(url + "/metrics", trust_env=False, timeout=30).text)


def run_ours(url: str, n: int, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / f"ours-{n}-{time.monotonic_ns()}.json"
    exe = Path(sys.executable).with_name("infra-agent")
    load = (["--request-rate", str(a.request_rate), "--burstiness", "1" if a.arrival == "poisson" else "inf"] if a.request_rate
            else ["--max-concurrency", str(a.concurrency)])
    cmd = [str(exe), "bench", url, "--num-requests", str(n), *load,
           "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--temperature", "1.0",
           "--warmup-requests", "1", "--no-progress", "--output", str(out)]
    subprocess.run(pinned(cmd, a.client_cpus), check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {"median_ttft_ms": r["median_ttft_ms"], "median_tpot_ms": r["median_tpot_ms"], "mean_ttft_ms": r["mean_ttft_ms"],
            "mean_tpot_ms": r["mean_tpot_ms"], "output_throughput": r["output_throughput"],
            "tokens": r["total_output_tokens"], "failed": r["failed"]}


def run_aiperf(url: str, n: int, a: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    art = work / f"aiperf-{n}-{time.monotonic_ns()}"
    cmd = [a.aiperf, "profile", "--model", "refstack-tiny", "--url", url, "--endpoint-type", "completions", "--streaming",
           "--tokenizer", "local/bytetok", "--synthetic-input-tokens-mean", str(a.input_len), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(a.output_len), "--output-tokens-stddev", "0",
           *(["--request-rate", str(a.request_rate), "--arrival-pattern", a.arrival] if a.request_rate
             else ["--concurrency", str(a.concurrency)]),
           "--request-count", str(n), "--warmup-request-count", "1", "--extra-inputs", "ignore_eos:true",
           "--extra-inputs", "temperature:1.0", "--use-server-token-count", "--ui-type", "none", "--artifact-dir", str(art)]
    subprocess.run(pinned(cmd, a.client_cpus), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    r = json.loads((art / "profile_export_aiperf.json").read_text())
    errors = (r.get("error_request_count") or {}).get("avg", 0) or 0
    return {"median_ttft_ms": r["time_to_first_token"]["p50"], "median_tpot_ms": r["inter_token_latency"]["p50"],
            "mean_ttft_ms": r["time_to_first_token"]["avg"], "mean_tpot_ms": r["inter_token_latency"]["avg"],
            "output_throughput": r["output_token_throughput"]["avg"], "tokens": r["total_osl"]["avg"], "failed": errors}


def run_guidellm(url: str, n: int, a: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    out = work / f"guidellm-{n}-{time.monotonic_ns()}.json"
    tok = next((Path(env["HF_HUB_CACHE"]) / "models--local--bytetok" / "snapshots").iterdir())
    cmd = [a.guidellm, "run", "--backend", f"kind=openai_http,target={url},request_format=/v1/completions",
           "--profile", f"kind={a.arrival},rate={a.request_rate}" if a.request_rate else f"kind=concurrent,streams={a.concurrency}",
           "--constraint", f"kind=max_requests,count={n}",
           "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},output_tokens={a.output_len}",
           "--tokenizer", f"kind=huggingface_auto,model={tok}", "--output", f"kind=json,path={out}",
           "--disable-console"]
    subprocess.run(pinned(cmd, a.client_cpus), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=env, cwd=work)
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    ok = {k: v["successful"] for k, v in m.items() if isinstance(v, dict) and "successful" in v}
    # guidellm's inter_token_latency is (e2e − TTFT)/(tokens − 1) per request, vLLM's TPOT;
    # its time_per_output_token also spreads the TTFT over the tokens.
    return {"median_ttft_ms": ok["time_to_first_token_ms"]["median"], "median_tpot_ms": ok["inter_token_latency_ms"]["median"],
            "mean_ttft_ms": ok["time_to_first_token_ms"]["mean"], "mean_tpot_ms": ok["inter_token_latency_ms"]["mean"],
            "output_throughput": ok["output_tokens_per_second"]["mean"],
            "tokens": ok["output_token_count"]["mean"] * ok["output_token_count"]["count"],
            "failed": m["request_totals"]["errored"] if isinstance(m.get("request_totals"), dict) else 0}


def measured(fn: Any, url: str, *args: Any) -> dict[str, Any]:
    before, cpu0 = scrape(url), child_cpu()
    res = fn(url, *args)
    res["cpu_s"] = child_cpu() - cpu0
    d = phase_deltas(before, scrape(url))
    res["server_ttft_ms"] = d["ttft"]["mean_s"] * 1e3
    res["server_tpot_ms"] = d["tpot"]["mean_s"] * 1e3
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default=shutil.which("aiperf"), help="the aiperf executable (its venv must have tokenizers)")
    ap.add_argument("--guidellm", default=shutil.which("guidellm"), help="the guidellm executable (second peer)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", type=int, default=60, help="requests in the small run (start-up cost reference)")
    ap.add_argument("--large", type=int, default=240, help="requests in the large run (the one compared)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--request-rate", type=float, default=0.0,
                    help="open-loop arrivals at this many requests/s instead of a closed loop at --concurrency: no "
                         "client can then time its sends to the engine's steps")
    ap.add_argument("--arrival", choices=["poisson", "constant"], default="poisson",
                    help="with --request-rate: Poisson gaps (each client draws its own), or constant gaps of "
                         "1/rate, the same send times for every client, so their windows and throughputs compare")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--server-cpus", default=None, help="pin the server to these CPUs (taskset list, e.g. 0)")
    ap.add_argument("--client-cpus", default=None, help="pin each client process to these CPUs (e.g. 1)")
    ap.add_argument("--server-step-delay-ms", type=float, default=0.0,
                    help="refstack --step-delay-ms: the engine sleeps this long per step, like a server waiting "
                         "on its GPU, which leaves the host's cores to the clients")
    a = ap.parse_args()
    peers = [p for p in ("aiperf", "guidellm") if getattr(a, p)]
    if not peers:
        sys.exit("no peer client found: pip install aiperf (or guidellm) into a separate venv and pass --aiperf/--guidellm PATH")
    work = Path(tempfile.mkdtemp(prefix="loadgen_fidelity_"))
    hub = work / "hf-hub"
    subprocess.run([str(Path(getattr(a, peers[0])).with_name("python")), "-c", _MAKE_TOKENIZER, str(hub)], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}

    runners = {"ours": lambda url, n: run_ours(url, n, a, work),
               "aiperf": lambda url, n: run_aiperf(url, n, a, work, env),
               "guidellm": lambda url, n: run_guidellm(url, n, a, work, env)}
    names = ["ours", *peers]
    res: dict[str, dict[int, list[dict[str, Any]]]] = {t: {a.small: [], a.large: []} for t in names}
    with ServerProcess(server_spec(a.server_cpus, a.server_step_delay_ms), {"threads": a.torch_threads}, work / "logs", name="refstack") as srv:
        measured(runners["ours"], srv.url, 16)  # warm the server once
        for rep in range(a.reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate who goes first
            for n in (a.small, a.large):
                for tool in order:
                    r = measured(runners[tool], srv.url, n)
                    res[tool][n].append(r)
                    print(f"rep {rep} {tool:8s} n={n}: {json.dumps({k: round(v, 3) for k, v in r.items()})}", file=sys.stderr)
    for peer in peers:
        report(res, "ours", peer, a)
    shape = f"{a.arrival} arrivals, {a.request_rate:g} req/s" if a.request_rate else f"concurrency {a.concurrency}"
    print(f"\nload: {shape}, {a.input_len} in / {a.output_len} out tokens, {a.large} requests per compared run, "
          f"{a.reps} reps; failed requests over all runs: {sum(r['failed'] for t in res.values() for runs in t.values() for r in runs)}")
    if a.server_step_delay_ms:
        print(f"server: refstack --step-delay-ms {a.server_step_delay_ms:g} (an engine that waits, like one on a GPU)")
    if a.server_cpus or a.client_cpus:
        print(f"pinned: server on CPU(s) {a.server_cpus}, clients on CPU(s) {a.client_cpus}")


def report(res: dict[str, dict[int, list[dict[str, Any]]]], ours: str, peer: str, a: argparse.Namespace) -> None:
    def med(tool: str, key: str) -> float:
        return statistics.median(r[key] for r in res[tool][a.large])

    def cpu_per_tok(tool: str) -> float:
        vals = [(big["cpu_s"] - small["cpu_s"]) / (big["tokens"] - small["tokens"])
                for small, big in zip(res[tool][a.small], res[tool][a.large])]
        return statistics.median(vals)

    def within(x: float) -> str:
        return "yes" if abs(x - 1) <= 0.05 else "no"

    rows = []
    for key, label in (("median_ttft_ms", "median TTFT [ms]"), ("median_tpot_ms", "median TPOT [ms]"),
                       ("output_throughput", "output throughput [tok/s]")):
        o, p = med(ours, key), med(peer, key)
        rows.append((label, f"{o:.2f}", f"{p:.2f}", f"{o / p:.3f}", within(o / p)))
    # The server's own histograms over the same run: how slow the server really was
    # while each client drove it (a heavier client slows a server on a shared box),
    # and how far each client's reading sits from that reference.
    for key, srv_key, label in (("mean_ttft_ms", "server_ttft_ms", "TTFT"), ("mean_tpot_ms", "server_tpot_ms", "TPOT")):
        so, sp = med(ours, srv_key), med(peer, srv_key)
        rows.append((f"server's own mean {label} during the runs [ms]", f"{so:.2f}", f"{sp:.2f}", f"{so / sp:.3f}", "-"))
        o = statistics.median(r[key] - r[srv_key] for r in res[ours][a.large])
        p = statistics.median(r[key] - r[srv_key] for r in res[peer][a.large])
        rows.append((f"client mean {label} minus server's [ms]", f"{o:+.2f}", f"{p:+.2f}", "-", "-"))
        o = statistics.median(r[key] / r[srv_key] for r in res[ours][a.large])
        p = statistics.median(r[key] / r[srv_key] for r in res[peer][a.large])
        rows.append((f"client mean {label} / server's", f"{o:.3f}", f"{p:.3f}", f"{o / p:.3f}", within(o / p)))
    co, cp = cpu_per_tok(ours), cpu_per_tok(peer)
    rows.append(("client CPU per streamed token [us]", f"{co * 1e6:.1f}", f"{cp * 1e6:.1f}", f"{co / cp:.3f}", "yes" if co <= cp else "no"))
    to = statistics.median(r["cpu_s"] / r["tokens"] for r in res[ours][a.large])
    tp = statistics.median(r["cpu_s"] / r["tokens"] for r in res[peer][a.large])
    rows.append((f"client CPU per token incl. start-up, n={a.large} [us]", f"{to * 1e6:.1f}", f"{tp * 1e6:.1f}", f"{to / tp:.3f}", "-"))
    print(f"\n| metric | infra-agent | {peer} | ratio | within goal |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
