"""``infra-agent demo``: build a workspace from refstack and run today's loop on it."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from infra_agent.cli.output import emit, err_console, user_errors
from infra_agent.demo import run_demo


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        workdir: Path = typer.Option(Path("infra-agent-demo"), "--workdir", help="Where to build the demo workspace (a git repo)."),
        pairs: int = typer.Option(3, "--pairs", min=2, help="Interleaved A/B pairs of runs for the knob hypothesis."),
        kernel_seeds: int = typer.Option(1, "--kernel-seeds", min=1, help="Fresh random seeds per kernel check."),
        as_json: bool = typer.Option(False, "--json", help="Print the demo report as JSON."),
    ) -> None:
        """Build a demo workspace from refstack and run the feedback loop's steps on it."""
        with user_errors(as_json):
            report = run_demo(workdir, pairs=pairs, kernel_seeds=kernel_seeds, console=None if as_json else err_console)

        def render(con) -> None:  # type: ignore[no-untyped-def]
            table = Table(title=f"infra-agent demo — workspace {report.workspace}")
            for col in ("step", "question", "outcome", "seconds"):
                table.add_column(col)
            for s in report.steps:
                table.add_row(s.name, s.question, s.outcome, f"{s.seconds:.1f}")
            con.print(table)
            con.print(f"report: {Path(report.workspace) / '.infra-agent' / 'demo' / 'demo.json'}")

        emit(report.as_dict(), as_json, render)
        if not report.ok:
            raise typer.Exit(code=1)
