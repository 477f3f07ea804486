"""``infra-agent validate [WORKSPACE]``: load a workspace and show what it declares."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra_agent.cli.output import emit, user_errors
from infra_agent.workspace import (
    Criterion,
    EndpointTargetSpec,
    JsonlDataset,
    RandomDataset,
    Scenario,
    SharedPrefixDataset,
    Workspace,
    load_workspace,
    parse_assignments,
    render_value,
)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


def validate(
    workspace: str = typer.Argument(".", help="Workspace folder, or its infra-agent.yaml."),
    set_: list[str] = typer.Option([], "--set", help="Check a knob value: name=value (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the normalised workspace as JSON."),
) -> None:
    """Check infra-agent.yaml: target, knobs, scenarios, criteria. Exit 2 on any problem."""
    with user_errors(as_json):
        ws = load_workspace(workspace)
        values = ws.resolve_knobs(parse_assignments(set_))
    # model_dump_json writes request_rate=inf as "Infinity" (valid JSON); a plain
    # json.dumps of model_dump() would write a bare Infinity token.
    result: dict[str, Any] = {
        "source": str(ws.source),
        "workspace": json.loads(ws.model_dump_json()),
        "knob_values": values,
    }
    emit(result, as_json, lambda console: _render(console, ws, values))


def _render(console: Console, ws: Workspace, values: dict[str, Any]) -> None:
    # User text goes through escape(): a `[x]` in a command or help line is not markup.
    console.print(f"[bold]workspace[/] {escape(str(ws.source))}" + (f"  ({escape(ws.name)})" if ws.name else ""))
    target = ws.target
    if isinstance(target, EndpointTargetSpec):
        console.print(f"[bold]target[/] endpoint {escape(target.url)}  metrics={escape(target.metrics_url or '-')}  model={escape(target.model or '-')}")
    else:
        command = target.command if isinstance(target.command, str) else " ".join(target.command)
        console.print(f"[bold]target[/] server: {escape(command)}", highlight=False)
        console.print(
            f"  ready={escape(target.ready_url)}  metrics={escape(target.metrics_url or '-')}"
            f"  timeout={target.ready_timeout_s:g}s  model={escape(target.model or '-')}",
            highlight=False,
        )

    knobs = Table(title="knobs", title_justify="left")
    for col in ("knob", "domain", "default", "value", "components", "help"):
        knobs.add_column(col)
    for name, knob in ws.knobs.items():
        default = "-" if knob.default is None else render_value(knob.default)
        value = "-" if name not in values else render_value(values[name])
        knobs.add_row(*(escape(c) for c in (name, knob.domain(), default, value, ", ".join(knob.components), knob.help)))
    console.print(knobs)

    scenarios = Table(title="scenarios", title_justify="left")
    for col in ("scenario", "dataset", "requests", "concurrency", "rate", "endpoint", "slo"):
        scenarios.add_column(col)
    for name, sc in ws.scenarios.items():
        row = (name, _dataset(sc), str(sc.num_requests), str(sc.max_concurrency or "-"), _rate(sc), sc.endpoint, _slo(sc))
        scenarios.add_row(*(escape(c) for c in row))
    console.print(scenarios)

    criteria = Table(title="criteria", title_justify="left")
    for col in ("criterion", "metric", "scenario", "gate"):
        criteria.add_column(col)
    for crit in ws.criteria:
        criteria.add_row(*(escape(c) for c in (crit.name, crit.metric, crit.scenario or "-", _gate(crit))))
    console.print(criteria)
    console.print("[green]ok[/]")


def _dataset(sc: Scenario) -> str:
    ds = sc.dataset
    if isinstance(ds, RandomDataset):
        spread = f" ±{ds.range_ratio:.0%}" if ds.range_ratio else ""
        return f"random in={ds.input_len} out={ds.output_len}{spread}"
    if isinstance(ds, SharedPrefixDataset):
        return f"shared_prefix {ds.num_prefixes}×{ds.prefix_len} + {ds.suffix_len}, out={ds.output_len}"
    assert isinstance(ds, JsonlDataset)
    return f"jsonl {ds.path.name} out={ds.output_len}"


def _rate(sc: Scenario) -> str:
    if sc.request_rate == float("inf"):
        return "inf"
    burst = f" (burstiness {sc.burstiness:g})" if sc.burstiness != 1.0 else ""
    return f"{sc.request_rate:g}/s{burst}"


def _slo(sc: Scenario) -> str:
    if sc.slo is None:
        return "-"
    parts = [f"{k}≤{v:g}" for k, v in sc.slo.model_dump().items() if v is not None]
    return " ".join(parts) or "-"


def _gate(crit: Criterion) -> str:
    if crit.ratio is not None:
        return f"{crit.op} {crit.ratio:g} × baseline"
    return f"{crit.op} {crit.value:g}"
