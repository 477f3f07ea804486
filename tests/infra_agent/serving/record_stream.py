"""Record one streamed answer of a live OpenAI-compatible server as a replayable fixture.

``python record_stream.py URL completions|chat OUT.jsonl [TEMPERATURE] [--model M] [--seed S]``
writes one line per ``data:`` event: ``{"dt_ms": gap since the previous event (or the
send), "data": the chunk, or "[DONE]"}``; ``fake_openai_server.py --replay`` sends it
back at the same pace.  The vLLM fixtures were recorded from ``vllm serve`` (vLLM 0.32,
CPU build) on ``tiny_llama.py``'s model, temperature 1.0, seed 2.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("endpoint", choices=["completions", "chat"])
    ap.add_argument("out")
    ap.add_argument("temperature", type=float, nargs="?", default=0.0)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--seed", type=int, default=2)
    a = ap.parse_args()
    prompt = "the serving benchmark measures one window of load"
    body: dict = {"model": a.model, "max_tokens": 16, "temperature": a.temperature, "seed": a.seed, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": True}
    if a.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if a.endpoint == "chat" else "/v1/completions"
    events = []
    with httpx.stream("POST", a.url + path, json=body, timeout=60, trust_env=False) as r:
        last = time.perf_counter()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter()
            payload = line[5:].strip()
            events.append({"dt_ms": round((now - last) * 1e3, 3), "data": payload if payload == "[DONE]" else json.loads(payload)})
            last = now
    with open(a.out, "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    print(f"{len(events)} events written to {a.out}")


if __name__ == "__main__":
    main()
