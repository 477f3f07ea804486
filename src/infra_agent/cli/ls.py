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
        with user_errors(as_json):
            root = workspace_root(workspace)
            db = root / LEDGER_REL
            rows: list[tuple[Any, list[Any]]] = []
            stale: set[str] = set()
            if db.is_file():  # no ledger: no run yet (and none is created by looking)
                from infra_agent.ledger import Ledger

                with Ledger(db) as ledger:
                    rows = [(r, ledger.experiments(r.id)) for r in ledger.list_runs()]
                    stale = {r.id for r, _ in rows if _is_stale(ledger, r)}

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


def _is_stale(ledger: Any, run: Any) -> bool:
    """A run recorded as ``running`` whose owner process on this machine is gone (killed, crashed).

    The owner's pid, host and start time are in the ledger; a run owned by another host cannot
    be checked from here and keeps its status.  ``infra-agent resume`` picks a stale run up."""
    import socket

    from infra_agent.agent.runner import live_owner

    if run.status != "running":
        return False
    owner = ledger.get_state(run.id, "owner") or {}
    if owner.get("host") not in (None, socket.gethostname()):
        return False
    return live_owner(ledger, run.id) is None


def first_line(message: str | None, width: int = 160) -> str:
    """The message column holds one line: a failure's message can carry a server's log tail."""
    line = (message or "").strip().splitlines()[0].strip() if (message or "").strip() else "-"
    return line if len(line) <= width else line[: width - 1] + "…"
