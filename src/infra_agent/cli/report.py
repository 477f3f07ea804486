"""``infra-agent report RUN``: one self-contained HTML file and a Markdown summary of a run."""

from __future__ import annotations

from pathlib import Path

import typer

from infra_agent.cli.output import emit, user_errors
from infra_agent.cli.runlog import write_run_report


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        run_id: str = typer.Argument(..., help="The run to report on (see `infra-agent ls`)."),
        workspace: Path = typer.Option(Path("."), "--workspace", "-w", help="The workspace of the run."),
        as_json: bool = typer.Option(False, "--json", help="Print the report's paths as JSON."),
    ) -> None:
        """Write the run's report: one self-contained HTML file and a Markdown summary.

        Both go to WORKSPACE/.infra-agent/reports/RUN/ (report.html and report.md).
        """
        with user_errors(as_json):
            paths = write_run_report(run_id, workspace)
        emit({"html": str(paths.html), "markdown": str(paths.markdown)}, as_json,
             lambda con: con.print(f"report: {paths.html}\n        {paths.markdown}", highlight=False))
