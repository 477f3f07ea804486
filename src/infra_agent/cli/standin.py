"""``infra-agent standin --script FILE``: the deterministic stand-in chat server.

It is not a model: it answers an OpenAI-compatible chat endpoint from a script of
tool calls, for tests and for trying ``--proposer llm`` without a hosted model.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import typer

from infra_agent.cli.output import emit, user_errors


def register(app: typer.Typer) -> None:
    @app.command("standin")
    def standin(
        script: Path = typer.Option(..., "--script", help="YAML/JSON turns of tool calls to answer with "
                                    "(format: infra_agent/standin/script.py)."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(0, "--port", help="Port, 0 to 65535 (0: a free one; the URL is printed)."),
        as_json: bool = typer.Option(False, "--json", help="Print the URL, model name and turns as one JSON object, then serve."),
    ) -> None:
        """Serve a scripted, deterministic stand-in for an OpenAI-compatible chat model (not a model).

        It serves until Ctrl-C.  Point the llm proposer at it:
        `infra-agent run WORKSPACE --proposer llm --model standin --base-url URL`.
        """
        with user_errors(as_json):
            from infra_agent.errors import ConfigError

            if not 0 <= port <= 65535:
                raise ConfigError("infra-agent standin", "--port", "a port from 0 to 65535 (0: a free one)", port)
            from infra_agent.standin.script import load_script
            from infra_agent.standin.server import serve_standin

            loaded = load_script(script)
            server = serve_standin(loaded, host, port)
            url = server.__enter__()
        try:
            info = {"url": url, "model": loaded.model, "turns": len(loaded.turns), "script": str(script)}

            def render(con: Any) -> None:
                con.print(f"stand-in chat server (a scripted replay, not a model) on {url}: {len(loaded.turns)} turn(s) "
                          f"from {script}; model name {loaded.model!r}\n"
                          f"use it with: infra-agent run WORKSPACE --proposer llm --model {loaded.model} --base-url {url}\n"
                          "Ctrl-C stops it", highlight=False, markup=False)

            emit(info, as_json, render)
            sys.stdout.flush()
            _serve_until_stopped()
        finally:
            server.__exit__(None, None, None)


def _serve_until_stopped() -> None:
    """Sleep until Ctrl-C or SIGTERM (the server runs in a thread)."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
