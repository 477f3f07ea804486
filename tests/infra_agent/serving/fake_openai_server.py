"""A tiny real OpenAI-compatible streaming server for client tests (run as a subprocess).

``python fake_openai_server.py [--token-delay-ms D] [--mode stream|json|die-after|empty] [--die-after N] [--no-usage] [--nagle]
[--api-key-env NAME] [--require-header 'Name: value'] [--replay FILE] [--tokenizer DIR] [--port P]``
binds a free loopback port itself and prints ``READY http://127.0.0.1:PORT`` once serving.
It exposes vLLM-named histograms under the ``refstack:`` prefix on /metrics so the
Prometheus delta can be checked against what it served.  With ``--api-key-env NAME`` it
answers every ``/v1`` request without ``Authorization: Bearer $NAME`` with 401, as vLLM's
``--api-key`` does (``/metrics`` stays open, as there).  ``--replay FILE`` answers every
generation request with a recorded stream (JSONL: ``{"dt_ms": gap before it, "data":
chunk or "[DONE]"}``), at its recorded pace.  ``--tokenizer DIR`` serves vLLM's
``POST /tokenize`` with that Hugging Face tokenizer (without it, /tokenize is a 404).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


def build_app(token_delay_s: float, mode: str, die_after: int, usage: bool = True, api_key: str | None = None,
              required: dict[str, str] | None = None, replay: list[dict] | None = None, tokenizer_dir: str | None = None) -> FastAPI:
    app = FastAPI()

    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

        @app.post("/tokenize")
        async def tokenize(req: Request) -> dict:
            body = await req.json()
            ids = tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
            return {"count": len(ids), "max_model_len": 4096, "tokens": ids}

    @app.middleware("http")
    async def check_auth(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path.startswith("/v1"):
            if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            for name, value in (required or {}).items():
                if request.headers.get(name) != value:
                    return JSONResponse({"error": f"missing header {name}"}, status_code=403)
        return await call_next(request)

    registry = CollectorRegistry()
    e2e = Histogram("refstack:e2e_request_latency_seconds", "e2e", registry=registry)
    queue = Histogram("refstack:request_queue_time_seconds", "queue", registry=registry)
    requested = Counter("fake_requested_tokens", "max_tokens over all requests served", registry=registry)
    served = {"n": 0}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode())

    async def handle(req: Request, chat: bool):
        body = await req.json()
        served["n"] += 1
        if mode == "die-after" and served["n"] > die_after:
            print(f"fake server: simulated crash after {die_after} requests", flush=True)
            os._exit(3)
        if mode == "json":
            return JSONResponse({"choices": [{"text": "hello", "index": 0}]})
        if replay is not None:
            async def recorded():
                for event in replay:
                    await asyncio.sleep(event["dt_ms"] / 1e3)
                    data = event["data"]
                    yield "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"

            return StreamingResponse(recorded(), media_type="text/event-stream")
        n = int(body.get("max_tokens", 16))
        requested.inc(n)
        include_usage = usage and bool((body.get("stream_options") or {}).get("include_usage"))
        prompt_tokens = len(str(body.get("prompt") or body.get("messages")).encode())
        t0 = time.perf_counter()
        queue.observe(0.001)

        async def gen():
            if chat:  # real chat servers open with a role-only chunk; TTFT must skip it
                yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
            for i in range(n if mode != "empty" else 0):  # "empty": tokens made, no text streamed
                await asyncio.sleep(token_delay_s)
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                yield "data: " + json.dumps({"choices": [choice]}) + "\n\n"
            if include_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
            e2e.observe(time.perf_counter() - t0)

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await handle(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: Request):
        return await handle(req, chat=True)

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--token-delay-ms", type=float, default=2.0)
    ap.add_argument("--mode", choices=["stream", "json", "die-after", "empty"], default="stream")
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--no-usage", action="store_true", help="never send a usage chunk")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--replay", help="answer every generation request with this recorded stream (JSONL)")
    ap.add_argument("--tokenizer", help="serve POST /tokenize with this local Hugging Face tokenizer folder")
    ap.add_argument("--api-key-env", help="require 'Authorization: Bearer $NAME' on /v1 requests")
    ap.add_argument("--require-header", action="append", default=[], help="'Name: value' every /v1 request must carry")
    ap.add_argument("--nagle", action="store_true",
                    help="listen on a proto-0 socket, so Nagle's algorithm stays on for accepted connections "
                         "(reproduces a real server bug: streamed chunks held behind delayed ACKs)")
    args = ap.parse_args()
    # IPPROTO_TCP so asyncio turns Nagle off on accepted connections (see refstack.cli._bind).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0 if args.nagle else socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))  # 0: the OS picks a free port
    port = sock.getsockname()[1]
    api_key = os.environ[args.api_key_env] if args.api_key_env else None
    required = dict((p.strip() for p in h.split(":", 1)) for h in args.require_header)
    replay = None
    if args.replay:
        with open(args.replay) as f:
            replay = [json.loads(line) for line in f if line.strip()]
    app = build_app(args.token_delay_ms / 1e3, args.mode, args.die_after, usage=not args.no_usage, api_key=api_key,
                    required=required, replay=replay, tokenizer_dir=args.tokenizer)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    print(f"READY http://127.0.0.1:{port}", flush=True)
    server.run(sockets=[sock])
    sys.exit(0)


if __name__ == "__main__":
    main()
