"""``infra-agent goodput WORKSPACE``: the highest request rate each configuration sustains under the SLO.

The scenario's ``goodput:`` section (or ``--slo-*-ms`` flags) gives the limits; each
configuration (``--set`` on the knob defaults, times every ``--grid`` combination) gets
one server, kept up while its rate is bisected (serving/goodput.py).  Progress goes to
stderr a line per decided rate; the sweep table goes to stdout and, with ``result.txt``
and ``result.json``, to ``--result-dir`` (default ``.infra-agent/goodput/<time>`` in the
workspace).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from infra_agent.cli.output import emit, err_console, user_errors


def register(app: typer.Typer) -> None:
    app.command("goodput")(goodput)


def _parse_grid(items: list[str]) -> dict[str, list[str]]:
    from infra_agent.errors import ConfigError

    grid: dict[str, list[str]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not name.strip() or not vals:
            raise ConfigError(None, "--grid", "knob=value1,value2,...", item)
        if name.strip() in grid:
            raise ConfigError(None, "--grid", f"each knob once ({name.strip()} is given twice)", item)
        grid[name.strip()] = vals
    return grid


def goodput(
    target: str = typer.Argument(".", help="Workspace folder (or its infra-agent.yaml), or a server's http(s) base URL."),
    scenario: str | None = typer.Option(None, "--scenario", help="Workspace scenario name (default: the only one)."),
    set_: list[str] = typer.Option([], "--set", help="Knob override knob=value for every configuration; repeatable."),
    grid: list[str] = typer.Option([], "--grid", help="knob=v1,v2,...: one configuration per value (combined across --grid)."),
    slo_ttft_ms: float | None = typer.Option(None, "--slo-ttft-ms", help="Limit on the percentile's TTFT (ms)."),
    slo_tpot_ms: float | None = typer.Option(None, "--slo-tpot-ms", help="Limit on the percentile's TPOT (ms)."),
    slo_e2el_ms: float | None = typer.Option(None, "--slo-e2el-ms", help="Limit on the percentile's E2E latency (ms)."),
    percentile: float | None = typer.Option(None, "--percentile", help="The percentile the limits apply to (default 99)."),
    rate_min: float | None = typer.Option(None, "--rate-min", help="Lowest request rate tried, req/s (default 0.5)."),
    rate_max: float | None = typer.Option(None, "--rate-max", help="Highest rate (default: the throughput at an unbounded rate)."),
    max_rates: int | None = typer.Option(None, "--max-rates", help="Rates tried in all (default 8)."),
    num_requests: int = typer.Option(32, "--num-requests", help="URL mode: requests per window."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", help="URL mode: cap on requests in flight."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="URL mode: gamma shape of the gaps; 1 is Poisson, inf constant."),
    input_len: int = typer.Option(128, "--input-len", help="URL mode: random prompts of this many tokens."),
    output_len: int = typer.Option(64, "--output-len", help="URL mode: answers of this many tokens."),
    endpoint: str = typer.Option("completions", "--endpoint", help="URL mode: completions | chat."),
    model: str | None = typer.Option(None, "--model", help="URL mode: model name (default: first of /v1/models)."),
    metrics_url: str | None = typer.Option(None, "--metrics-url", help="URL mode: the server's Prometheus /metrics."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="URL mode: byte | hf:PATH (the served model's tokenizer)."),
    result_dir: Path | None = typer.Option(None, "--result-dir", help="Write result.txt and result.json here."),
    no_progress: bool = typer.Option(False, "--no-progress"),
    as_json: bool = typer.Option(False, "--json", help="Print the sweep as JSON."),
) -> None:
    """Search the highest request rate meeting the SLO, per configuration, and print the sweep table."""
    slo = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms, "e2el_ms": slo_e2el_ms}
    overrides = {"percentile": percentile, "rate_min": rate_min, "rate_max": rate_max, "max_rates": max_rates}

    def say(line: str) -> None:
        if not no_progress:
            err_console.print(line, highlight=False, markup=False)

    with user_errors(as_json):
        from infra_agent.cli.bench import check_target_text
        from infra_agent.serving.goodput_run import write_sweep

        check_target_text(target)
        if target.startswith(("http://", "https://")):
            url_load = {"dataset": {"kind": "random", "input_len": input_len, "output_len": output_len},
                        "num_requests": num_requests, "max_concurrency": max_concurrency, "burstiness": burstiness,
                        "endpoint": endpoint, "tokenizer": tokenizer}
            sweep, root = _url_sweep(target, url_load, slo, overrides, model, metrics_url, say, set_ + grid), Path(".")
        else:
            sweep, root = _workspace_sweep(target, scenario, set_, grid, slo, overrides, say)
        folder = result_dir or root / ".infra-agent" / "goodput" / time.strftime("%Y%m%d-%H%M%S")
        txt, js = write_sweep(sweep, folder)
    result: dict[str, Any] = {**sweep, "result_txt": str(txt), "result_json": str(js)}
    emit(result, as_json, lambda console: _render(console, sweep, str(txt)))


def _workspace_sweep(target: str, scenario: str | None, sets: list[str], grid: list[str], slo: dict[str, Any],
                     overrides: dict[str, Any], say: Any) -> tuple[dict[str, Any], Path]:
    from infra_agent.cli.bench import parse_sets
    from infra_agent.probes.workspace_checks import load_workspace
    from infra_agent.serving.goodput_run import grid_configs, run_sweep, search_settings
    from infra_agent.serving.runner import only_scenario

    ws = load_workspace(target)
    name = scenario or only_scenario(ws)
    search = search_settings(ws.scenario(name), name, slo, str(ws.source) if ws.source else None, overrides)
    configs = grid_configs(parse_sets(sets), _parse_grid(grid))
    for c in configs:
        ws.resolve_knobs(c)  # a wrong knob or value stops here, before any server starts
    say(f"goodput: {len(configs)} configuration(s) of scenario {name} on {ws.source}")
    return run_sweep(ws, name, configs, search, say), ws.root


def _url_sweep(url: str, load: dict[str, Any], slo: dict[str, Any], overrides: dict[str, Any], model: str | None,
               metrics_url: str | None, say: Any, knob_flags: list[str]) -> dict[str, Any]:
    from infra_agent.cli.bench import _scenario, base_url
    from infra_agent.errors import ConfigError
    from infra_agent.serving.datasets import load_tokenizer
    from infra_agent.serving.goodput_run import run_url, search_settings

    if knob_flags:
        raise ConfigError(url, "--set/--grid", "no knob flags for a URL (its server's configuration is fixed; use a workspace)",
                          knob_flags)
    if all(v is None for v in slo.values()):
        raise ConfigError(None, "--slo-ttft-ms / --slo-tpot-ms / --slo-e2el-ms", "at least one limit for a URL", None)
    sc = _scenario({k: v for k, v in load.items() if v is not None})
    search = search_settings(sc, "url", slo, "infra-agent goodput", overrides)
    tok = load_tokenizer(sc.tokenizer, "--tokenizer") if sc.tokenizer else None
    say(f"goodput: the server at {base_url(url)}")
    return run_url(base_url(url), "url", sc, search, say, metrics_url=metrics_url, model=model, tokenizer=tok)


def _render(console: Console, sweep: dict[str, Any], txt: str) -> None:
    from infra_agent.serving.goodput_run import _num

    table = Table(title=f"goodput sweep, scenario {sweep['scenario']}")
    for col in ("configuration", "goodput req/s", "bracket req/s", "request_goodput at it (95% CI)", "max throughput req/s",
                "goodput / max", "rates", "windows", "note"):
        table.add_column(col, justify="left" if col in ("configuration", "note") else "right")
    for r in sweep["configurations"]:
        if r.get("error"):
            table.add_row(r["label"], "-", "-", "-", "-", "-", "-", "-", r["error"][:120])
            continue
        gp = r.get("request_goodput_at") or {}
        ci = f"{_num(gp.get('mean'))} [{_num(gp.get('low'))}, {_num(gp.get('high'))}]" if gp else "-"
        lo, hi = r["bracket"]
        table.add_row(r["label"], _num(r["goodput_rps"]), f"[{_num(lo)}, {_num(hi)}]", ci, _num(r.get("max_throughput_rps")),
                      _num(r.get("of_max_throughput"), ".0%"), str(len(r["rates"])), str(r["windows"]), r["stopped"])
    console.print(table)
    best = sweep.get("best")
    console.print(f"best: {best['label']} at {_num(best['goodput_rps'])} req/s" if best else "best: no configuration meets the SLO",
                  highlight=False)
    console.print(f"written: {txt} (and result.json beside it)", highlight=False)
