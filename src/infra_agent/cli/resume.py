"""``infra-agent resume RUN``: continue a killed or interrupted run from its ledger."""

from __future__ import annotations

from pathlib import Path

import typer

from infra_agent.cli.output import emit, err_console, user_errors
from infra_agent.cli.runlog import run_summary, render_run, write_run_report


def register(app: typer.Typer) -> None:
    @app.command("resume")
    def resume(
        run_id: str = typer.Argument(..., help="The run to continue (see `infra-agent ls`)."),
        workspace: Path = typer.Option(Path("."), "--workspace", "-w", help="The workspace of the run."),
        no_report: bool = typer.Option(False, "--no-report"),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Continue a run that was killed or interrupted; finished experiments are kept, none is repeated."""
        with user_errors(as_json):
            from infra_agent.agent.runner import resume_run

            record = resume_run(workspace, run_id, console=err_console, progress=True)
            report = None if no_report else write_run_report(record.id, workspace)
        emit(run_summary(record, report), as_json, render_run(record, report))
        if record.status == "error":
            raise typer.Exit(code=1)
