"""``infra-agent compare A.json B.json``: B against A (baseline) with bootstrap intervals.

Each file may hold one result, a list of results, or ``{"runs": [...]}`` (what the
interleaved A/B driver writes).  With several runs per side the interval comes from
the per-run values (paired when the counts match); with one run per side it comes
from per-request samples, which exist for the latency metrics only.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from infra_agent.bench.results import load_runs
from infra_agent.cli.output import emit, user_errors
from infra_agent.judge.verdict import Comparison, compare_runs, parse_gate

DEFAULT_METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms")
_COLOR = {"pass": "green", "fail": "red", "inconclusive": "yellow"}


def render_comparison(comp: Comparison, console: Console, a: Path, b: Path) -> None:
    table = Table(title=f"{b.name} vs {a.name} (ratio = B/A)")
    for col, just in (("metric", "left"), ("A", "right"), ("B", "right"), ("ratio", "right"), ("95% CI", "right"), ("from", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    for mc in comp.metrics:
        ci = mc.ci
        table.add_row(
            mc.metric,
            "-" if mc.baseline is None else f"{mc.baseline:.4g}",
            "-" if mc.candidate is None else f"{mc.candidate:.4g}",
            "-" if ci is None else f"{ci.ratio:.4f}",
            "-" if ci is None else f"[{ci.low:.4f}, {ci.high:.4f}]",
            Text(mc.note),
        )
    console.print(table)
    for v in comp.verdicts:
        color = _COLOR[v.outcome]
        line = f"[{color}]{v.outcome.upper()}[/] {escape(v.gate)}: {escape(v.message)}"
        if v.more_samples is not None:
            line += f"; about {v.more_samples} more samples would likely decide it"
        console.print(line)


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare(
        a: Path = typer.Argument(..., help="Baseline result JSON."),
        b: Path = typer.Argument(..., help="Candidate result JSON."),
        metric: list[str] = typer.Option([], "--metric", help="Result key to compare; repeatable."),
        criterion: list[str] = typer.Option([], "--criterion", help="Gate on the B/A ratio, e.g. 'output_throughput>=0.95'."),
        confidence: float = typer.Option(0.95, "--confidence"),
        n_boot: int = typer.Option(2000, "--n-boot"),
        seed: int = typer.Option(0, "--seed"),
        process_noise: float = typer.Option(
            0.0, "--process-noise", min=0.0,
            help="Spread (sd of the log ratio) between two fresh server processes with the same settings, from an A/A "
                 "calibration (bench/ab_power.py reports it); widens the interval by it over the runs' restarts."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Per-metric ratio B/A with a bootstrap CI, and a verdict per criterion."""
        with user_errors(as_json):
            gates = [parse_gate(c) for c in criterion]
            runs_a, runs_b = load_runs(a), load_runs(b)
            # Defaults are only those both files hold (a failed run holds none of them).
            present = [m for m in DEFAULT_METRICS if any(m in r for r in runs_a) and any(m in r for r in runs_b)]
            comp = compare_runs(runs_a, runs_b, metric or present, gates, confidence=confidence, n_boot=n_boot, seed=seed,
                                process_noise=process_noise)
            emit(comp.as_dict(), as_json, lambda console: render_comparison(comp, console, a, b))
            if any(v.outcome == "fail" for v in comp.verdicts):
                raise typer.Exit(code=1)
