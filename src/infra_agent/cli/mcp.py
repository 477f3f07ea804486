"""``infra-agent mcp``: the agent's tools and the environment's verbs as an MCP server (stdio or HTTP).

The ``mcp`` package, the workspace models and the loop are imported inside the
command: see ``infra_agent.cli.main``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType

import typer

from infra_agent.cli.output import err_console, user_errors


def register(app: typer.Typer) -> None:
    app.command("mcp")(mcp)


def mcp(
    transport: str = typer.Option("stdio", "--transport", help="stdio (the client starts this process) | http "
                                                               "(streamable HTTP at http://HOST:PORT/mcp)."),
    workspace: Path = typer.Option(Path("."), "--workspace", "-w", help="Workspace folder (holding infra-agent.yaml) "
                                                                        "or the file."),
    budget_runs: int = typer.Option(8, "--budget-runs", min=1, help="Most experiments this session may run."),
    budget_s: float | None = typer.Option(None, "--budget-s", min=1, help="Wall seconds after which no probe or "
                                                                          "experiment starts in this session."),
    pairs: int = typer.Option(3, "--pairs", min=3, help="Interleaved A/B pairs per end-to-end comparison."),
    probe_timeout_s: float = typer.Option(900.0, "--probe-timeout-s", min=1, help="Kill a probe run after this long."),
    check_timeout_s: float = typer.Option(300.0, "--check-timeout-s", min=1, help="Kill a check run after this long."),
    run: str | None = typer.Option(None, "--run", help="Continue this MCP run of the ledger instead of opening a new one."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (http)."),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="Port to listen on (http)."),
) -> None:
    """Serve the agent's tools and the environment's verbs to MCP clients (stdio or HTTP)."""
    with user_errors():
        from infra_agent.errors import ConfigError

        if transport not in ("stdio", "http"):
            raise ConfigError("infra-agent mcp", "--transport", "stdio or http", transport)
        from infra_agent.mcp.server import run as serve
        from infra_agent.mcp.session import McpOptions, McpSession

        session = McpSession(workspace, McpOptions(budget_runs=budget_runs, budget_s=budget_s, pairs=pairs,
                                                   probe_timeout_s=probe_timeout_s, check_timeout_s=check_timeout_s,
                                                   run=run))

        def stop(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
        if transport == "http":
            err_console.print(f"infra-agent MCP server on http://{host}:{port}/mcp (workspace {session.ws.root})",
                              highlight=False)
        try:
            serve(session, transport, host, port)
        except KeyboardInterrupt:
            pass
        finally:
            for s, h in saved.items():
                signal.signal(s, h)
            found = session.close()
            if found:
                err_console.print("cleaned up: " + ", ".join(found), highlight=False)
