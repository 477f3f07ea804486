"""``infra-agent calibrate [WORKSPACE]``: the spread between two fresh server processes.

The loop starts fresh servers for every batch of pairs; two processes of one
configuration differ by an offset that the pairs inside one batch share.  This verb
measures that offset's spread (A/A blocks of the baseline, serving/calibrate_noise.py)
and writes ``.infra-agent/process-noise.json``; ``run`` then widens its interval by it
(``--process-noise auto``, the default).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from infra_agent.cli.output import emit, err_console, user_errors

if TYPE_CHECKING:
    from infra_agent.serving.noise_record import NoiseCalibration


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    workspace: str = typer.Argument(".", help="Workspace folder, or its infra-agent.yaml."),
    scenario: str | None = typer.Option(None, "--scenario", help="Scenario to measure (default: the first criterion's)."),
    blocks: int = typer.Option(6, "--blocks", min=2, help="Fresh pairs of identical servers (A/A blocks)."),
    pairs: int = typer.Option(3, "--pairs", min=2, help="Interleaved windows per block (a batch of the loop)."),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration as JSON."),
) -> None:
    """Measure the spread between fresh server processes of one configuration; the loop's interval uses it."""
    with user_errors(as_json):
        from infra_agent.errors import BenchmarkError, ConfigError
        from infra_agent.probes.workspace_checks import load_workspace
        from infra_agent.serving.calibrate_noise import calibrate as run_calibration
        from infra_agent.serving.noise_record import save

        ws = load_workspace(workspace)
        name = scenario or _default_scenario(ws)
        if name not in ws.scenarios:
            raise ConfigError("--scenario", None, f"one of the scenarios of {ws.source} ({', '.join(ws.scenarios)})", name)
        total = blocks * pairs

        def window(block: int, i: int, side: str) -> None:
            if not as_json and side == "b":
                err_console.print(f"calibrate: block {block + 1}/{blocks}, window {i + 1}/{pairs} "
                                  f"({block * pairs + i + 1}/{total} pairs)", highlight=False)

        if not as_json:
            err_console.print(f"calibrate: {blocks} fresh A/A server pairs x {pairs} windows of scenario {name} "
                              f"on {ws.source}", highlight=False)
        try:
            cal = run_calibration(ws, name, blocks=blocks, pairs=pairs, on_window=window)
        except ValueError as exc:
            raise BenchmarkError(f"calibrate: {exc}") from exc
        path = save(ws.root, cal)
    result: dict[str, Any] = {"file": str(path), **cal.model_dump(mode="json")}
    emit(result, as_json, lambda console: _render(console, cal, str(path)))


def _default_scenario(ws: Any) -> str:
    crit = next((c for c in ws.criteria if getattr(c, "scenario", None)), None)
    return crit.scenario if crit is not None else next(iter(ws.scenarios))


def _render(console: Console, cal: NoiseCalibration, path: str) -> None:
    from infra_agent.judge.process_noise import SPREAD_P, shown_taus
    from infra_agent.judge.sequential import detectable_effect

    table = Table(title=f"spread between fresh server processes, scenario {cal.scenario} "
                        f"({cal.blocks} blocks x {cal.pairs_per_block} windows)")
    for col in ("metric", "tau (between processes)", "within a process pair", "F", "p", "the loop adds",
                "one batch detects"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    added = shown_taus(cal)
    for name, m in cal.metrics.items():
        # What one batch of the loop (one fresh process pair, pairs_per_block windows) can decide at 90% power.
        tau = added[name]
        mde = detectable_effect(m.within_sd, cal.pairs_per_block, process_noise=tau, batch=cal.pairs_per_block)
        table.add_row(name, f"{m.tau:.2%}", f"{m.within_sd:.2%}", "-" if m.f is None else f"{m.f:.2f}",
                      "-" if m.p is None else f"{m.p:.2f}", f"{tau:.2%}" if tau else f"none (p >= {SPREAD_P:g})",
                      f">= {mde:.1%}" if math.isfinite(mde) else "-")
    console.print(table)
    load = f"load {cal.load_before} -> {cal.load_after}" if cal.load_before is not None else "load unknown"
    console.print(f"{cal.wall_s:.0f} s on {cal.machine.hostname} ({cal.machine.usable_cpus} usable CPUs), {load}; "
                  f"written to {path}; `infra-agent run` uses it (--process-noise auto)", highlight=False)
