"""``infra-agent validate [WORKSPACE]``: load a workspace and show what it declares.

Secrets never reach the output: the value of a ``target.env`` (or ``target.headers``)
entry whose name looks secret (``HF_TOKEN``, ``*_KEY``, ``*PASSWORD*``:
``infra_agent.safety.secret_name``) is shown as ``***``, in the human summary and in
``--json``, and so is any place where such a value, the value after a secret flag of
the command (``--api-key VALUE``), a URL's password (``postgres://user:***@host/db``),
or a secret of the environment infra-agent runs in recurs.

The workspace models (pydantic) are imported inside the command: see ``infra_agent.cli.main``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra_agent.cli.output import emit, user_errors

if TYPE_CHECKING:
    from infra_agent.workspace import Criterion, Scenario, Workspace


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


# Target fields that map names to values: a value under a secret-looking name is masked.
_NAMED_VALUES = ("env", "headers")


def _secrets(ws: Workspace) -> list[str]:
    """The values to mask: the target's (env, command flags, headers, URL passwords) and the process's."""
    from infra_agent.safety import workspace_secrets

    return workspace_secrets(ws)


def masked(value: Any, secrets: list[str]) -> Any:
    """``value`` with every recurrence of a secret value, and every secret known by its form, masked."""
    from infra_agent.safety import scrub

    return scrub(value, secrets)


def _masked_workspace(data: dict[str, Any], secrets: list[str]) -> dict[str, Any]:
    from infra_agent.safety import MASK, secret_name

    target = dict(data.get("target") or {})
    for f in _NAMED_VALUES:
        if isinstance(target.get(f), dict):
            # a value under a secret-looking name is masked whatever it is, as in the human summary
            target[f] = {k: MASK if secret_name(k) and v else v for k, v in target[f].items()}
    return masked({**data, "target": target}, secrets)


def validate(
    workspace: str = typer.Argument(".", help="Workspace folder, or its infra-agent.yaml."),
    set_: list[str] = typer.Option([], "--set", help="Check a knob value: name=value (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the normalised workspace as JSON."),
) -> None:
    """Check infra-agent.yaml: target, knobs, scenarios, criteria. Exit 2 on any problem."""
    with user_errors(as_json):
        from infra_agent.probes.workspace_checks import load_workspace
        from infra_agent.workspace import parse_assignments

        ws = load_workspace(workspace)
        values = ws.resolve_knobs(parse_assignments(set_))
    secrets = _secrets(ws)
    # model_dump_json writes request_rate=inf as "Infinity" (valid JSON); a plain
    # json.dumps of model_dump() would write a bare Infinity token.
    result: dict[str, Any] = {
        "source": str(ws.source),
        "workspace": _masked_workspace(json.loads(ws.model_dump_json()), secrets),
        "knob_values": masked(values, secrets),
        "search_space": search_space(ws),
    }
    emit(result, as_json, lambda console: _render(console, ws, values, secrets))


def search_space(ws: Workspace) -> dict[str, Any]:
    """What a search may sample: each numeric knob's scale, typical range and machine bound
    (with where the bound comes from), the aliases, the constraints, and the machine."""
    from infra_agent.workspace.machine import knob_bound

    limits = ws.machine_limits()
    knobs: dict[str, Any] = {}
    for name, knob in ws.knobs.items():
        entry: dict[str, Any] = {}
        if knob.type in ("int", "float") and knob.min is not None and knob.max is not None:
            entry["scale"] = "log" if knob.log_scale else "linear"
        if knob.typical is not None:
            entry["typical"] = knob.typical
        bound = knob_bound(name, knob, limits)
        if bound is not None:
            entry.update(resource=knob.resource, per_process=knob.processes, bound=bound.limit, bound_from=bound.source)
        if knob.aliases:
            entry["aliases"] = {str(k): v for k, v in knob.aliases.items()}
        if entry:
            knobs[name] = entry
    return {"machine": limits.to_dict(), "knobs": knobs,
            "constraints": [{"constraint": c.text, "knobs": list(c.knobs)} for c in ws.parsed_constraints]}


def _search_cell(entry: dict[str, Any] | None) -> str:
    """``log; typical [4, 256]; <= 2 (threads x 1 process)`` for the knobs table."""
    from infra_agent.workspace import render_value

    if not entry:
        return "-"
    parts = [entry["scale"]] if "scale" in entry else []
    if "typical" in entry:
        parts.append("typical [{}, {}]".format(*entry["typical"]))
    if "bound" in entry:
        n = entry["per_process"]
        parts.append(f"<= {entry['bound']:g} ({entry['resource']} x {n} process{'es' if n != 1 else ''})")
    if "aliases" in entry:
        parts.append(", ".join(f"{k} = {render_value(v)}" for k, v in entry["aliases"].items()))
    return "; ".join(parts)


def _render(console: Console, ws: Workspace, values: dict[str, Any], secrets: list[str] | None = None) -> None:
    from infra_agent.safety import MASK, secret_name
    from infra_agent.workspace import EndpointTargetSpec, render_value

    secrets = secrets or []

    def show(text: str) -> str:
        # User text goes through escape(): a `[x]` in a command or help line is not markup.
        return escape(masked(text, secrets))

    console.print(f"[bold]workspace[/] {escape(str(ws.source))}" + (f"  ({escape(ws.name)})" if ws.name else ""))
    target = ws.target
    if isinstance(target, EndpointTargetSpec):
        console.print(f"[bold]target[/] endpoint {show(target.url)}  metrics={show(target.metrics_url or '-')}  model={show(target.model or '-')}")
    else:
        command = target.command if isinstance(target.command, str) else " ".join(target.command)
        console.print(f"[bold]target[/] server: {show(command)}", highlight=False)
        console.print(
            f"  ready={show(target.ready_url)}  metrics={show(target.metrics_url or '-')}"
            f"  timeout={target.ready_timeout_s:g}s  model={show(target.model or '-')}",
            highlight=False,
        )
    for f in _NAMED_VALUES:
        named = getattr(target, f, None) or {}
        if named:
            shown = "  ".join(f"{k}={MASK if secret_name(k) else masked(v, secrets)}" for k, v in named.items())
            console.print(f"  {f}: {escape(shown)}", highlight=False)

    space = search_space(ws)
    knobs = Table(title="knobs", title_justify="left")
    for col in ("knob", "domain", "search", "default", "value", "components", "help"):
        knobs.add_column(col)
    for name, knob in ws.knobs.items():
        default = "-" if knob.default is None else render_value(knob.default)
        value = "-" if name not in values else render_value(values[name])
        row = (name, knob.domain(), _search_cell(space["knobs"].get(name)), default, value, ", ".join(knob.components), knob.help)
        knobs.add_row(*(show(c) for c in row))
    console.print(knobs)
    m = space["machine"]
    memory = "memory unknown" if m["memory_gib"] is None else f"{m['memory_gib']:g} GiB ({m['memory_from']})"
    console.print(f"[bold]machine[/] {m['cores']} cores ({escape(m['cores_from'])}), {escape(memory)}", highlight=False)
    if space["constraints"]:
        console.print("[bold]constraints[/] " + "  ".join(escape(c["constraint"]) for c in space["constraints"]), highlight=False)

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
    from infra_agent.workspace import JsonlDataset, RandomDataset, SharedPrefixDataset

    ds = sc.dataset
    if isinstance(ds, RandomDataset):
        spread = f" ±{ds.range_ratio:.0%}" if ds.range_ratio else ""
        return f"random in={ds.input_len} out={ds.output_len}{spread}"
    if isinstance(ds, SharedPrefixDataset):
        return f"shared_prefix {ds.num_prefixes}×{ds.prefix_len} + {ds.suffix_len}, out={ds.output_len}"
    if ds.kind == "random_mm":
        return (f"random_mm in={ds.input_len} out={ds.output_len}, {ds.base_items_per_request} image(s) of "
                f"{'/'.join(ds.bucket_config)}, {ds.text_only_ratio:.0%} text-only")
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
