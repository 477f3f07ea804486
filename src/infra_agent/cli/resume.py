"""``infra-agent resume RUN``: continue a killed or interrupted run from its ledger."""

from __future__ import annotations

from pathlib import Path

import typer

from infra_agent.cli.output import err_console, user_errors
from infra_agent.cli.runlog import drive_run


def register(app: typer.Typer) -> None:
    @app.command("resume")
    def resume(
        run_id: str = typer.Argument(..., help="The run to continue (see `infra-agent ls`)."),
        workspace: Path = typer.Option(Path("."), "--workspace", "-w", help="The workspace of the run."),
        address: str | None = typer.Option(None, "--address", help="The Ray cluster to continue on, when it moved (a run "
                                           "started with --executor ray; default: the address it was started with)."),
        no_report: bool = typer.Option(False, "--no-report", help="Do not write the HTML/Markdown report."),
        as_json: bool = typer.Option(False, "--json", help="Print the run record as JSON on stdout (progress goes to stderr)."),
    ) -> None:
        """Continue a run that was killed or interrupted; finished experiments are kept, none is repeated.

        What the dead run left (its servers, worktrees and temporary branches) is removed
        first; the experiment that was in flight runs again as it was proposed.  A run
        whose confirmation did not confirm (`not_confirmed`) resumes to top that
        confirmation up: one more round of pairs pooled with its own, nothing else
        measured again.  A run that finished (done, or its budget spent) is not resumed.
        Exit status as for `infra-agent run`.
        """
        from infra_agent.agent.runner import resume_run

        if address is not None:
            with user_errors(as_json):
                _set_address(workspace, run_id, address)
        drive_run(lambda: resume_run(workspace, run_id, console=err_console, progress=True), workspace, no_report, as_json)


def _set_address(workspace: Path, run_id: str, address: str) -> None:
    """Record a new cluster address in the run's options, which ``resume`` reads."""
    from infra_agent.cli.runlog import ledger_path, workspace_root
    from infra_agent.errors import ConfigError
    from infra_agent.ledger import Ledger

    with Ledger(ledger_path(workspace_root(workspace), run_id)) as ledger:
        run = ledger.get_run(run_id)
        if run.options.get("executor", "local") != "ray":
            raise ConfigError("--address", None, "a run started with --executor ray", f"run {run_id} runs locally")
        run.options["address"] = address
        ledger.save_run(run)
