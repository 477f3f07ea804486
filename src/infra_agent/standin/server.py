"""A deterministic stand-in for a hosted chat model: an OpenAI-compatible server that
answers from a script.  It is NOT a model: it does not read the conversation to decide
anything; it replays the turns of its script, in order, whatever it is sent.

It exists for tests (real HTTP on loopback, with injected faults: HTTP 401/429/500,
delays past a client's timeout, a required API key) and for users without a model
endpoint who want to watch the ``llm`` proposer drive the loop with a fixed plan.

Endpoints:

- ``POST /v1/chat/completions``: non-streaming (``stream: false``) chat completions
  whose answers are the script's turns: tool calls or text; ``usage`` is estimated
  at four characters a token;
- ``GET /v1/models``: the one model name of the script;
- ``GET /standin/requests``: every request received, in order (for tests).

Use it in code with :func:`serve_standin` (a context manager that yields the base URL,
ending in ``/v1``), or from a shell::

    python -m infra_agent.standin.server --script plan.yaml --port 8001

The script format is described in :mod:`infra_agent.standin.script`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from infra_agent.errors import InfraAgentError
from infra_agent.standin.script import Script, ScriptPlayer, load_script, parse_script

_START_TIMEOUT_S = 15.0


def build_app(player: ScriptPlayer, stopping: threading.Event | None = None) -> FastAPI:
    """The FastAPI app serving ``player``'s script."""
    app = FastAPI(title="infra-agent stand-in chat server", docs_url=None, redoc_url=None, openapi_url=None)
    stop = stopping or threading.Event()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return player.models()

    @app.get("/standin/requests")
    async def requests() -> list[dict[str, Any]]:
        return list(player.requests)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        ans = player.answer(body, request.headers.get("authorization"))
        waited = 0.0
        while waited < ans.delay_s and not stop.is_set():  # a delay that ends when the server stops
            step = min(0.05, ans.delay_s - waited)
            await asyncio.sleep(step)
            waited += step
        return JSONResponse(ans.body, status_code=ans.status)

    return app


def _as_script(script: Script | str | Path | list[Any] | dict[str, Any]) -> Script:
    if isinstance(script, (str, Path)):
        return load_script(script)
    return parse_script(script)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)  # connections wait in the backlog until the server accepts them
    except OSError as exc:
        sock.close()
        raise InfraAgentError(f"the stand-in cannot listen on {host}:{port}: {exc}") from None
    return sock


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


@contextlib.contextmanager
def serve_standin(script: Script | str | Path | list[Any] | dict[str, Any], host: str = "127.0.0.1",
                  port: int = 0) -> Iterator[str]:
    """Serve ``script`` (a Script, a file path, or parsed YAML/JSON) in a thread; yields ``http://HOST:PORT/v1``."""
    import uvicorn

    player = ScriptPlayer(_as_script(script))
    stopping = threading.Event()
    sock = _bind(host, port)
    config = uvicorn.Config(build_app(player, stopping), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="infra-agent-standin", daemon=True)
    thread.start()
    try:
        if not _wait_started(server, thread):
            raise InfraAgentError(f"the stand-in chat server did not start within {_START_TIMEOUT_S:.0f} s")
        yield _url(host, sock.getsockname()[1])
    finally:
        stopping.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


def _wait_started(server: Any, thread: threading.Thread) -> bool:
    import time

    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.started:
            return True
        if not thread.is_alive():
            return False
        time.sleep(0.01)
    return False


def received_requests(base_url: str) -> list[dict[str, Any]]:
    """Every request the stand-in at ``base_url`` received so far (``GET /standin/requests``)."""
    import httpx

    origin = base_url.rstrip("/").removesuffix("/v1")
    resp = httpx.get(origin + "/standin/requests", timeout=10, trust_env=False)
    resp.raise_for_status()
    data: list[dict[str, Any]] = resp.json()
    return data


def main(argv: list[str] | None = None) -> int:
    """``python -m infra_agent.standin.server --script FILE [--host H] [--port N]``; serves until interrupted."""
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m infra_agent.standin.server",
        description="Serve a deterministic stand-in for a hosted chat model (OpenAI-compatible, answers from a "
                    "script; not a model).")
    parser.add_argument("--script", required=True, help="the script: YAML or JSON turns (see infra_agent.standin.script)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free one)")
    args = parser.parse_args(argv)
    try:
        script = load_script(args.script)
        sock = _bind(args.host, args.port)
    except InfraAgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    url = _url(args.host, sock.getsockname()[1])
    print(f"stand-in chat server (a scripted replay, not a model) on {url}: {len(script.turns)} turns "
          f"from {args.script}; model name {script.model!r}", flush=True)
    config = uvicorn.Config(build_app(ScriptPlayer(script)), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
