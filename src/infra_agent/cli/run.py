"""``infra-agent run``: the agent loop on a workspace until its gates pass or the budget ends."""

from __future__ import annotations

from pathlib import Path

import typer

from infra_agent.cli.output import emit, err_console, user_errors
from infra_agent.cli.runlog import run_summary, render_run, write_run_report


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        workspace: Path = typer.Argument(Path("."), help="Workspace folder (holding infra-agent.yaml) or the file."),
        proposer: str = typer.Option("rules", "--proposer", help="rules | search | llm"),
        budget_runs: int = typer.Option(8, "--budget-runs", min=1, help="Most experiments after the baseline."),
        budget_s: float | None = typer.Option(None, "--budget-s", min=1, help="Wall-time budget in seconds."),
        pairs: int = typer.Option(3, "--pairs", min=3, help="Interleaved A/B pairs per end-to-end comparison."),
        scenario: list[str] = typer.Option([], "--scenario", help="Run only these scenarios (repeatable)."),
        playbook: str | None = typer.Option(None, "--playbook", help="Rules playbook YAML (rules proposer)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the search proposer."),
        blind: bool = typer.Option(False, "--blind", help="Search all knobs without attribution (search proposer)."),
        model: str | None = typer.Option(None, "--model", help="Model name (llm proposer)."),
        base_url: str | None = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint (llm proposer); key from "
                                                                     "INFRA_AGENT_API_KEY or OPENAI_API_KEY."),
        probe_timeout_s: float = typer.Option(900.0, "--probe-timeout-s", min=1, help="Kill a probe run after this long."),
        no_confirm: bool = typer.Option(False, "--no-confirm", help="Skip the final best-vs-baseline confirmation."),
        keep_going: bool = typer.Option(False, "--keep-going", help="Go on after every gate passes, until the budget ends."),
        no_report: bool = typer.Option(False, "--no-report", help="Do not write the HTML/Markdown report."),
        as_json: bool = typer.Option(False, "--json", help="Print the run record as JSON."),
    ) -> None:
        """Run the agent loop on a workspace until its gates pass or the budget ends."""
        with user_errors(as_json):
            from pydantic import ValidationError

            from infra_agent.agent.runner import RunOptions, start_run
            from infra_agent.errors import ConfigError

            try:
                opts = RunOptions(proposer=proposer, budget_runs=budget_runs, budget_s=budget_s, pairs=pairs,  # type: ignore[arg-type]
                                  scenarios=list(scenario) or None, playbook=playbook, seed=seed, blind=blind, model=model,
                                  base_url=base_url, probe_timeout_s=probe_timeout_s, confirm=not no_confirm,
                                  keep_going=keep_going)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ConfigError("infra-agent run", f"--{str(err['loc'][0]).replace('_', '-')}", err["msg"].removeprefix("Input should be "),
                                  err.get("input")) from None
            record = start_run(workspace, opts, console=err_console, progress=True)
            report = None if no_report else write_run_report(record.id, workspace)
        emit(run_summary(record, report), as_json, render_run(record, report))
        if record.status == "error":
            raise typer.Exit(code=1)
