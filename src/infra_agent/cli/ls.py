"""``infra-agent ls``: the runs in a workspace's ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from infra_agent.cli.output import emit, user_errors


def register(app: typer.Typer) -> None:
    @app.command("ls")
    def ls(
        workspace: Path = typer.Argument(Path("."), help="The workspace whose ledger to list."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """List the runs in a workspace's ledger."""
        with user_errors(as_json):
            from infra_agent.ledger import Ledger
            from infra_agent.workspace import load_workspace

            ws = load_workspace(workspace)
            with Ledger.for_workspace(ws.root) as ledger:
                rows = [(r, ledger.experiments(r.id)) for r in ledger.list_runs()]

        def render(con: Any) -> None:
            from rich.table import Table

            table = Table(title=f"runs in {ws.root}/.infra-agent/ledger.db")
            for col in ("run", "proposer", "status", "experiments", "accepted", "best", "gates after", "message"):
                table.add_column(col)
            for r, exps in rows:
                passed = sum(g.outcome == "pass" for g in r.gates_after)
                table.add_row(r.id, r.proposer, r.status, str(sum(e.role == "experiment" for e in exps)),
                              str(sum(e.accepted and e.role == "experiment" for e in exps)), r.best or "-",
                              f"{passed}/{len(r.gates_after)}" if r.gates_after else "-", r.message[:60])
            con.print(table)

        emit([{**r.model_dump(mode="json"), "experiments": len(e)} for r, e in rows], as_json, render)
