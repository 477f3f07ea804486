"""``infra-agent resume RUN``: continue a killed or interrupted run from its ledger."""

from __future__ import annotations

from pathlib import Path

import typer

from infra_agent.cli.output import emit, err_console, user_errors
from infra_agent.cli.runlog import (
    exit_interrupted,
    render_run,
    run_summary,
    workspace_root,
    write_run_report,
)


def register(app: typer.Typer) -> None:
    @app.command("resume")
    def resume(
        run_id: str = typer.Argument(..., help="The run to continue (see `infra-agent ls`)."),
        workspace: Path = typer.Option(Path("."), "--workspace", "-w", help="The workspace of the run."),
        no_report: bool = typer.Option(False, "--no-report", help="Do not write the HTML/Markdown report."),
        as_json: bool = typer.Option(False, "--json", help="Print the run record as JSON on stdout (progress goes to stderr)."),
    ) -> None:
        """Continue a run that was killed or interrupted; finished experiments are kept, none is repeated.

        What the dead run left (its servers, worktrees and temporary branches) is removed
        first; the experiment that was in flight runs again as it was proposed.  A run
        that finished (every gate passes, or its budget is spent) is not resumed.  Exit
        status as for `infra-agent run`.
        """
        with user_errors(as_json):
            from infra_agent.agent.runner import resume_run

            try:
                record = resume_run(workspace, run_id, console=err_console, progress=True)
            except KeyboardInterrupt as exc:
                exit_interrupted(exc, as_json)
            report = None if no_report else write_run_report(record.id, workspace)
            root = workspace_root(workspace)
        emit(run_summary(record, report), as_json, render_run(record, report, root))
        if record.status == "error":
            raise typer.Exit(code=1)
