"""A goodput sweep over a workspace's configurations: one server per configuration, kept up
for every window of its search, and a table of what each configuration sustains.

The sweep table is written twice: ``result.txt`` (one line per configuration, then the
best, in the spirit of vLLM auto_tune's ``result.txt``) and ``result.json`` (every rate
tried, its windows, each limit's interval).  A configuration whose server does not start
is a row with its error; the sweep goes on with the next.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from infra_agent.errors import ConfigError, InfraAgentError
from infra_agent.serving.goodput import search_goodput
from infra_agent.serving.metrics import percentile_key
from infra_agent.serving.runner import default_log_dir, run_on_target
from infra_agent.serving.telemetry import sample_during
from infra_agent.target import open_target
from infra_agent.workspace.goodput import GoodputSearch
from infra_agent.workspace.models import Scenario, Slo, Workspace

Say = Callable[[str], None]


def grid_configs(sets: Mapping[str, str], grid: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    """Every combination of the grid's values (in the order given), each on top of ``sets``."""
    if not grid:
        return [dict(sets)]
    names = list(grid)
    return [{**sets, **dict(zip(names, combo, strict=True))} for combo in itertools.product(*(grid[n] for n in names))]


def search_settings(scenario: Scenario, name: str, slo_flags: Mapping[str, float | None] | None = None,
                    file: str | None = None, overrides: Mapping[str, Any] | None = None) -> GoodputSearch:
    """The scenario's ``goodput:`` settings, with SLO limits and search settings (``rate_min``,
    ``rate_max``, ...) from flags on top; a scenario without ``goodput:`` needs at least one
    limit from the flags."""
    flags = {k: v for k, v in (slo_flags or {}).items() if v is not None}
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if scenario.goodput is None:
        if not flags:
            raise ConfigError(file, f"scenarios.{name}.goodput",
                              "a goodput: section (slo: {ttft_ms|tpot_ms|e2el_ms}) or --slo-*-ms flags", None)
        data: dict[str, Any] = {"slo": flags}
    else:
        data = scenario.goodput.model_dump()
        data["slo"] = {**data["slo"], **flags}
    try:
        return GoodputSearch.model_validate({**data, **given})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "goodput"
        raise ConfigError(file, f"scenarios.{name}.goodput.{where}", err["msg"], err.get("input")) from None


def _label(knobs: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in knobs.items()) or "defaults"


def run_configuration(ws: Workspace, name: str, scenario: Scenario, search: GoodputSearch, overrides: Mapping[str, str],
                      say: Say, prompt_sets: itertools.count[int], log_dir: Path) -> dict[str, Any]:
    """Launch the target once with ``overrides`` and search its goodput on it."""
    label = _label(overrides)
    row: dict[str, Any] = {"config": dict(overrides), "label": label}
    try:
        values = ws.resolve_knobs(overrides)
    except ConfigError as exc:
        return {**row, "error": str(exc)}
    row["knobs"] = values
    pcts = sorted({50.0, 90.0, 99.0, float(search.percentile)})
    slo = Slo(**search.slo.model_dump())

    def measure(rate: float, index: int) -> dict[str, Any]:
        # request_rate is the search's; the SLO makes each window count vLLM's goodput.
        sc = scenario.model_copy(update={"request_rate": rate, "slo": slo})
        sampler = sample_during(target.metrics_url, getattr(target, "request_headers", None), target.url)
        try:
            result = run_on_target(target, sc, scenario_name=name, knobs=values, progress=False, percentiles=pcts,
                                   prompt_set=next(prompt_sets) if scenario.fresh_prompts_per_window else None)
        finally:
            tel = sampler.stop() if sampler is not None else None
        if tel is not None:
            result["engine_telemetry"] = tel
        return result

    say(f"goodput: {label}: starting the target")
    try:
        with open_target(ws, values, log_dir) as target:
            row.update(search_goodput(measure, search, say, label=f"{label}: "))
            row["log_path"] = str(target.log_path) if target.log_path else None
    except InfraAgentError as exc:
        row["error"] = str(exc)
        say(f"goodput: {label}: {exc}")
    return row


def run_sweep(ws: Workspace, name: str, configs: Sequence[Mapping[str, str]], search: GoodputSearch,
              say: Say = lambda _s: None, scenario: Scenario | None = None) -> dict[str, Any]:
    """Search every configuration's goodput, one after the other; the best is the highest."""
    sc = scenario or ws.scenario(name)
    log_dir = default_log_dir(ws)
    prompt_sets = itertools.count()  # every window of the sweep gets prompts of its own
    rows = [run_configuration(ws, name, sc, search, c, say, prompt_sets, log_dir) for c in configs]
    found = [r for r in rows if r.get("goodput_rps") is not None]
    best = max(found, key=lambda r: r["goodput_rps"]) if found else None
    return {"scenario": name, "search": search.model_dump(), "configurations": rows,
            "best": {"label": best["label"], "config": best["config"], "goodput_rps": best["goodput_rps"]} if best else None}


def run_url(url: str, name: str, scenario: Scenario, search: GoodputSearch, say: Say = lambda _s: None, *,
            metrics_url: str | None = None, model: str | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """The search against an already-running server: one configuration, the server's own."""
    from infra_agent.serving.runner import run_benchmark

    pcts = sorted({50.0, 90.0, 99.0, float(search.percentile)})
    slo = Slo(**search.slo.model_dump())
    prompt_sets = itertools.count()

    def measure(rate: float, index: int) -> dict[str, Any]:
        sc = scenario.model_copy(update={"request_rate": rate, "slo": slo})
        return run_benchmark(url, sc, model=model, metrics_url=metrics_url, progress=False, percentiles=pcts,
                             tokenizer=tokenizer, prompt_set=next(prompt_sets) if scenario.fresh_prompts_per_window else None)

    row: dict[str, Any] = {"config": {}, "label": url}
    try:
        row.update(search_goodput(measure, search, say, label=f"{url}: "))
    except InfraAgentError as exc:
        row["error"] = str(exc)
        say(f"goodput: {url}: {exc}")
    best = row if row.get("goodput_rps") is not None else None
    return {"scenario": name, "search": search.model_dump(), "configurations": [row],
            "best": {"label": url, "config": {}, "goodput_rps": best["goodput_rps"]} if best else None}


def _num(x: Any, fmt: str = ".3g") -> str:
    return "-" if not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, fmt)


def row_text(row: Mapping[str, Any], search: GoodputSearch) -> str:
    """One configuration as a ``result.txt`` line."""
    if row.get("error"):
        return f"{row['label']}: error: {row['error']}"
    lo, hi = row["bracket"]
    gp = row.get("request_goodput_at") or {}
    ci = f" [{_num(gp.get('low'))}, {_num(gp.get('high'))}]" if gp.get("low") is not None else ""
    limits = ", ".join(f"{c['metric']}: {_num(c.get('geomean'), '.1f')} (limit {c['limit_ms']:g})" for c in row.get("checks_at", []))
    tried = len(row.get("rates", []))
    return (f"{row['label']}: goodput_rps: {_num(row['goodput_rps'])}, bracket: [{_num(lo)}, {_num(hi)}] req/s, "
            f"request_goodput: {_num(gp.get('mean'))}{ci} req/s"
            + (f", max_throughput: {_num(row['max_throughput_rps'])} req/s ({_num(row['of_max_throughput'], '.0%')} of it)"
               if row.get("of_max_throughput") is not None else "")
            + (f", {limits}" if limits else "")
            + f", rates: {tried}, windows: {row.get('windows', 0)}; {row.get('stopped', '')}")


def sweep_text(sweep: Mapping[str, Any]) -> str:
    search = GoodputSearch.model_validate(sweep["search"])
    slo = ", ".join(f"{percentile_key(search.percentile)}_{m}_ms <= {v:g}" for m, v in search.slo.limits().items())
    lines = [f"# goodput search, scenario {sweep['scenario']}: the highest request rate with {slo} "
             f"({search.confidence:.0%} t-intervals over {search.min_windows}-{search.max_windows} windows a rate)"]
    lines += [row_text(r, search) for r in sweep["configurations"]]
    best = sweep.get("best")
    lines.append(f"best: {best['label']}, goodput_rps: {_num(best['goodput_rps'])}" if best else "best: none meets the SLO")
    return "\n".join(lines) + "\n"


def write_sweep(sweep: Mapping[str, Any], folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    txt, js = folder / "result.txt", folder / "result.json"
    txt.write_text(sweep_text(sweep))
    js.write_text(json.dumps(sweep, indent=1, default=str))
    return txt, js
