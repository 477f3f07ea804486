"""``infra-agent ls``: the runs in a workspace's ledger."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from infra_agent.cli.output import emit, user_errors
from infra_agent.cli.runlog import LEDGER_REL, workspace_root


def register(app: typer.Typer) -> None:
    @app.command("ls")
    def ls(
        workspace: Path = typer.Argument(Path("."), help="The workspace whose ledger to list."),
        as_json: bool = typer.Option(False, "--json", help="Print the runs as a JSON list (newest first)."),
    ) -> None:
        """List the runs in a workspace's ledger."""
        from infra_agent.agent.run_status import first_line, is_stale

        with user_errors(as_json):
            root = workspace_root(workspace)
            db = root / LEDGER_REL
            rows: list[tuple[Any, list[Any]]] = []
            stale: set[str] = set()
            if db.is_file():  # no ledger: no run yet (and none is created by looking)
                from infra_agent.ledger import Ledger

                with Ledger(db) as ledger:
                    rows = [(r, ledger.experiments(r.id)) for r in ledger.list_runs()]
                    stale = {r.id for r, _ in rows if is_stale(ledger, r)}

        def render(con: Any) -> None:
            from rich.table import Table
            from rich.text import Text

            if not rows:
                con.print(f"no runs in {root} yet; start one with `infra-agent run {root}`", highlight=False)
                return
            table = Table(title=f"runs in {db}", title_justify="left")
            for col in ("run", "started", "proposer", "status", "experiments", "accepted", "best", "gates after"):
                table.add_column(col, no_wrap=True)
            table.add_column("message", overflow="fold")
            for r, exps in rows:
                passed = sum(g.outcome == "pass" for g in r.gates_after)
                status = "stale" if r.id in stale else r.status
                table.add_row(r.id, time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started_at)), r.proposer, status,
                              str(sum(e.role == "experiment" for e in exps)),
                              str(sum(e.accepted and e.role == "experiment" for e in exps)), r.best or "-",
                              f"{passed}/{len(r.gates_after)} pass" if r.gates_after else "-", Text(first_line(r.message)))
            con.print(table)

        emit([{**r.model_dump(mode="json"), "experiments": len(e), "stale": r.id in stale} for r, e in rows], as_json,
             render)
