"""``infra-agent demo``: build a workspace from refstack and run the agent loop on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from infra_agent.cli.output import emit, err_console, user_errors


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        workdir: Path = typer.Option(Path("infra-agent-demo"), "--workdir", help="Where to build the demo workspace (a git repo)."),
        pairs: int = typer.Option(3, "--pairs", min=3, help="Interleaved A/B pairs per end-to-end comparison."),
        budget_runs: int = typer.Option(6, "--budget-runs", min=1, help="Most experiments after the baseline."),
        as_json: bool = typer.Option(False, "--json", help="Print the demo's run as JSON."),
    ) -> None:
        """Build a demo workspace from refstack and run the feedback loop's steps on it."""
        # numpy, scipy, aiohttp: imported only when the demo runs
        from infra_agent.demo import run_demo

        with user_errors(as_json):
            result = run_demo(workdir, pairs=pairs, budget_runs=budget_runs, console=err_console, progress=True)

        def render(con: Any) -> None:
            from rich.table import Table

            from infra_agent.agent.progress import gate_table

            table = Table(title=f"infra-agent demo: run {result.run.id} in {result.workspace}")
            for col in ("experiment", "hypothesis", "change", "probe (tier)", "verdict", "accepted", "seconds"):
                table.add_column(col)
            for e in result.experiments:
                table.add_row(e.id, e.hypothesis.statement[:90], ", ".join(f"{k}={v}" for k, v in e.change.knobs.items()) or "-",
                              f"{e.probe.name} ({e.probe.tier.value})" if e.probe else "serving+checks (e2e)",
                              e.verdict.outcome if e.verdict else e.status, "yes" if e.accepted and e.role == "experiment" else "",
                              f"{e.cost.wall_s:.1f}")
            con.print(table)
            con.print(gate_table(result.run.gates_before, "gates before (baseline)"))
            con.print(gate_table(result.run.gates_after, "gates after (best vs baseline)"))
            fixed = ", ".join(result.fixed) or "none"
            con.print(f"fixed: {fixed}\nreport: {result.report_html}\n        {result.report_markdown}", highlight=False)

        emit(result.as_dict(), as_json, render)
        if result.run.status == "error":
            raise typer.Exit(code=1)
