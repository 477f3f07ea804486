"""The client-server TTFT gap, split where the server's instants allow.

A client's TTFT runs from its send to the first token's bytes; the engine's own TTFT
(its Prometheus histogram) from the request's arrival at the engine to the token's
sampling.  What lies between is the HTTP side, and a server that marks the hand-overs
splits it.  refstack marks each request (``request_id`` in every instant's args):

| instant | where |
|---|---|
| ``http.submit`` | the handler hands the parsed, tokenised request to the engine |
| ``engine.admit`` | the engine loop takes it from its inbox (the engine sees it) |
| ``engine.first_token`` | the engine samples its first token |
| ``http.first_write`` | the handler resumes after the server wrote that token's event |

so that per request:

- **admission** = ``http.submit`` -> ``engine.admit`` (handed over -> seen);
- **engine** = ``engine.admit`` -> ``engine.first_token`` (queue and prefill);
- **first-token delivery** = ``engine.first_token`` -> ``http.first_write`` (emitted ->
  bytes written: the event loop, the stream's encoding, the write);
- **before the hand-over** = the client's mean TTFT minus the mean of ``http.submit`` ->
  ``http.first_write``: the network, the HTTP parse and the tokenisation, and the client.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from infra_agent.feedback import Finding
from infra_agent.trace.model import Instant
from infra_agent.vocabulary import FindingKind

MARKS = ("http.submit", "engine.admit", "engine.first_token", "http.first_write")
PHASES = (("admission", "http.submit", "engine.admit", "handed to the engine -> the engine sees it"),
          ("engine", "engine.admit", "engine.first_token", "the engine sees it -> first token sampled"),
          ("delivery", "engine.first_token", "http.first_write", "first token sampled -> its bytes written"))


def ttft_split(instants: list[Instant]) -> dict[str, Any] | None:
    """Per phase, the mean/p50/p99 (ms) over the requests that carry both of its marks; None when
    the trace marks no request so."""
    import numpy as np

    marks: dict[str, dict[str, float]] = defaultdict(dict)
    for i in instants:
        rid = i.args.get("request_id")
        if i.name in MARKS and isinstance(rid, str):
            marks[rid].setdefault(i.name, i.ts_us)  # the first of each: a request is submitted once
    out: dict[str, Any] = {"requests": len(marks), "phases": {}}
    for name, a, b, what in PHASES:
        ms = [(m[b] - m[a]) / 1e3 for m in marks.values() if a in m and b in m and m[b] >= m[a]]
        if ms:
            out["phases"][name] = {"what": what, "n": len(ms), "mean_ms": float(np.mean(ms)),
                                   "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}
    served = [(m["http.first_write"] - m["http.submit"]) / 1e3 for m in marks.values()
              if "http.submit" in m and "http.first_write" in m]
    if served:
        out["submit_to_write_mean_ms"] = float(np.mean(served))
    return out if out["phases"] else None


def split_ttft_gap(findings: list[Finding], split: dict[str, Any] | None) -> None:
    """Add the split to every ``client_server_ttft_gap`` finding, its largest part named first."""
    if split is None:
        return
    phases = split["phases"]
    for f in findings:
        if f.kind != FindingKind.CLIENT_SERVER_TTFT_GAP:
            continue
        parts = {k: float(v["mean_ms"]) for k, v in phases.items()}
        client = f.evidence.get("client_ttft_ms")
        if isinstance(client, (int, float)) and "submit_to_write_mean_ms" in split:
            parts["before the hand-over"] = max(float(client) - float(split["submit_to_write_mean_ms"]), 0.0)
        words = {"admission": "admission (handed to the engine -> engine sees it)",
                 "engine": "the engine (queue and prefill)", "delivery": "first-token delivery (emitted -> bytes written)",
                 "before the hand-over": "before the hand-over (network, HTTP parse, tokenisation, client)"}
        ranked = sorted(parts.items(), key=lambda kv: -kv[1])
        f.message += "; split by the server's marks (means): " + ", ".join(f"{words[k]} {v:.1f} ms" for k, v in ranked)
        f.evidence["ttft_split"] = {**split, "parts_ms": parts}
        top = ranked[0][0]
        f.next_question = {
            "admission": "Why does the engine take long to see a submitted request (its inbox lock, its wake-up, a "
                         "long step before it drains the inbox)?",
            "engine": "Is it queueing or prefill (server_queue/prefill phases)? Batch capacity or a slow prefill?",
            "delivery": "What holds the first token between the engine and the socket: the event loop (loop_stalls), "
                        "the stream's encoding, a thread that hands the output over?",
            "before the hand-over": "Is time lost before the engine has the request: the HTTP parse, the tokeniser, "
                                    "a busy event loop accepting it, or the client itself?",
        }[top]
