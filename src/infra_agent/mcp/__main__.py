"""``python -m infra_agent.mcp [OPTIONS]``: the same server as ``infra-agent mcp [OPTIONS]``."""

from __future__ import annotations

import typer

from infra_agent.cli.mcp import register

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
register(app)

if __name__ == "__main__":
    app()
