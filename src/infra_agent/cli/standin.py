"""``infra-agent standin --script FILE``: the deterministic stand-in chat server.

It is not a model: it answers an OpenAI-compatible chat endpoint from a script of
tool calls, for tests and for trying ``--proposer llm`` without a hosted model.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("standin")
    def standin(
        script: Path = typer.Option(..., "--script", help="YAML/JSON turns of tool calls to answer with."),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(0, "--port", min=0, max=65535, help="Port (0: a free one; the URL is printed)."),
    ) -> None:
        """Serve a scripted, deterministic stand-in for an OpenAI-compatible chat model (not a model)."""
        from infra_agent.llm.standin import main

        raise typer.Exit(code=main(["--script", str(script), "--host", host, "--port", str(port)]))
