"""``infra-agent compare A.json B.json``: B against A (baseline) with the judge's intervals.

Each file may hold one result, a list of results, or ``{"runs": [...]}`` (what the
interleaved A/B driver writes).  With several runs per side the interval comes from
the per-run values (paired when the counts match).  With one run per side the judge
gives no interval and asks for repeated runs; ``--per-request`` adds a descriptive
bootstrap over the requests of those two runs (latency metrics only; it ignores
between-run variance, says so, and its verdicts stay inconclusive).

Exit status: 0 when the comparison ran and no gate failed; 1 when a gate failed or a
side has no successful run; 2 on a user error (an unreadable or malformed file, a bad
option, A and B with different workloads without ``--allow-mismatch``).

The judge (numpy, scipy) is imported inside the command: see ``infra_agent.cli.main``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from infra_agent.cli.output import emit, err_console, user_errors
from infra_agent.errors import BenchmarkError, ConfigError

if TYPE_CHECKING:
    from infra_agent.judge.verdict import Comparison

DEFAULT_METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms")
_COLOR = {"pass": "green", "fail": "red", "inconclusive": "yellow"}
_SIDE = {"A": "A (baseline)", "B": "B (candidate)"}
_RESULT_FORMS = "a benchmark result object (what `infra-agent bench -o` writes), a list of them, or {\"runs\": [...]}"


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def read_runs(path: Path, side: str) -> list[dict[str, Any]]:
    """The runs of one side's file, each checked to be a result (or a failed run).

    Every problem is a ``BenchmarkError`` that names the side, the file, the run and
    what was wrong.
    """
    label = f"{_SIDE[side]} file {path}"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BenchmarkError(f"{label}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BenchmarkError(f"{label}: not a readable result JSON (a binary file: byte {exc.start} is not UTF-8 text); "
                             f"expected {_RESULT_FORMS}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchmarkError(f"{label}: not a readable result JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if isinstance(data, dict) and "runs" in data:
        runs, where = data["runs"], "runs[{}]"
        if not isinstance(runs, list) or not runs:
            got = "an empty list" if runs == [] else f"{_json_kind(runs)} ({json.dumps(runs)[:60]})"
            raise BenchmarkError(f"{label}: `runs` is {got}; expected a non-empty list of result objects")
    elif isinstance(data, list):
        runs, where = data, "item {}"
        if not runs:
            raise BenchmarkError(f"{label}: an empty list; expected {_RESULT_FORMS}")
    elif isinstance(data, dict):
        runs, where = [data], ""
    else:
        raise BenchmarkError(f"{label}: holds {_json_kind(data)}; expected {_RESULT_FORMS}")
    for i, run in enumerate(runs):
        at = where.format(i) + ": " if where else ""
        if not isinstance(run, dict):
            raise BenchmarkError(f"{label}: {at}{_json_kind(run)}; expected a result object")
        ok = run.get("ok", True)
        if not isinstance(ok, bool):
            raise BenchmarkError(f"{label}: {at}`ok` is {ok!r}; expected true or false")
        if not ok:
            continue  # a failed run: its error is reported, not compared
        if "completed" not in run:
            keys = f"its keys: {', '.join(list(run)[:8])}" if run else "an empty object"
            raise BenchmarkError(f"{label}: {at}not a benchmark result, as it has no `completed` count ({keys}); "
                                 f"expected {_RESULT_FORMS}")
        done = run["completed"]
        if isinstance(done, bool) or not isinstance(done, int) or done < 0:
            raise BenchmarkError(f"{label}: {at}`completed` is {done!r}; expected the number of completed requests (an integer >= 0)")
    return runs


def _check_metrics(path: Path, side: str, runs: list[dict[str, Any]], metrics: list[str]) -> None:
    """Every compared metric is a finite number in every successful run of the side."""
    import difflib

    label = f"{_SIDE[side]} file {path}"
    many = len(runs) > 1
    for i, run in enumerate(runs):
        if not run.get("ok", True) or not run.get("completed"):
            continue
        at = f"runs[{i}]: " if many else ""
        for m in metrics:
            if m not in run:
                keys = [k for k, v in run.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
                close = difflib.get_close_matches(m, keys, n=3)
                hint = f"did you mean {', '.join(close)}?" if close else f"it holds {', '.join(keys[:16])}"
                raise BenchmarkError(f"{label}: {at}no metric {m!r}; {hint}")
            value = run[m]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                why = " (request_goodput is null when the run had no SLO)" if m == "request_goodput" and value is None else ""
                raise BenchmarkError(f"{label}: {at}{m} is {value!r}{why}; expected a finite number")


def _check_options(confidence: float, n_boot: int) -> None:
    from infra_agent.judge.verdict import MIN_BOOT

    if not 0.0 < confidence < 1.0:
        raise BenchmarkError(f"--confidence: expected a number between 0 and 1 (exclusive), e.g. 0.95; got {confidence:g}")
    if n_boot < MIN_BOOT:
        raise BenchmarkError(f"--n-boot: expected at least {MIN_BOOT} bootstrap replicates (default 2000); got {n_boot}")


def _default_metrics(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> list[str]:
    """The default metrics both sides hold; a side with no successful run does not narrow them."""
    def held(runs: list[dict[str, Any]]) -> set[str] | None:
        ok = [r for r in runs if r.get("ok", True) and r.get("completed")]
        return {m for m in DEFAULT_METRICS if all(m in r for r in ok)} if ok else None

    sides = [h for h in (held(runs_a), held(runs_b)) if h is not None]
    keep = set.intersection(*sides) if sides else set(DEFAULT_METRICS)
    return [m for m in DEFAULT_METRICS if m in keep]


def render_comparison(comp: Comparison, console: Console, a: Path, b: Path, warnings: list[str] | None = None) -> None:
    from infra_agent.judge.verdict import PER_REQUEST_LABEL

    table = Table(title=f"{b.name} vs {a.name} (ratio = B/A)")
    for col, just in (("metric", "left"), ("A", "right"), ("B", "right"), ("ratio", "right"), ("95% CI", "right"), ("from", "left")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    if comp.metrics and comp.metrics[0].ci is not None:
        table.columns[4].header = f"{comp.metrics[0].ci.confidence:.0%} CI"
    for mc in comp.metrics:
        ci = mc.ci
        table.add_row(
            mc.metric,
            "-" if mc.baseline is None else f"{mc.baseline:.4g}",
            "-" if mc.candidate is None else f"{mc.candidate:.4g}",
            "-" if mc.ratio is None else f"{mc.ratio:.4f}",
            "-" if ci is None else f"[{ci.low:.4f}, {ci.high:.4f}]",
            Text(mc.note),
        )
    console.print(table)
    for line in warnings or ():
        console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)
    for side, why in comp.failed.items():
        console.print(f"[bold red]{_SIDE[side]} FAILED[/] ({escape(str(a if side == 'A' else b))}): {escape(why)}", highlight=False)
    for v in comp.verdicts:
        color = _COLOR[v.outcome]
        line = f"[{color}]{v.outcome.upper()}[/] {escape(v.gate)}: {escape(v.message)}"
        # A per-request interval decides nothing however many requests: its verdict already
        # asks for runs ("2 more each"), and more requests would not decide it.
        if v.more_samples is not None and v.low is not None and PER_REQUEST_LABEL not in v.message:
            line += f"; about {v.more_samples} more samples would likely decide it"
        console.print(line, highlight=False)


# Results written before the latency definition was recorded used the content-based one.
_DEFINITION_BEFORE_RECORDED = "content"


def measurement_mismatch(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]]) -> list[str]:
    """What the numbers mean, beside what was run: the latency definition and the tokenizer.

    A TTFT under vLLM's definition (first chunk) and one under the content-based one
    (first text) are different quantities, and so are prompt lengths counted by
    different tokenizers: comparing them would report the definition as a change.
    """
    out = []
    for key, missing in (("latency_definition", _DEFINITION_BEFORE_RECORDED), ("tokenizer_id", "byte")):
        va = sorted({str(r.get(key, missing)) for r in a_runs if r.get("ok", True) is not False})
        vb = sorted({str(r.get(key, missing)) for r in b_runs if r.get("ok", True) is not False})
        if va and vb and va != vb:
            out.append(f"{key}: A {', '.join(va)}, B {', '.join(vb)}")
    return out


def register(app: typer.Typer) -> None:
    @app.command("compare")
    def compare(
        a: Path = typer.Argument(..., help="Baseline result JSON."),
        b: Path = typer.Argument(..., help="Candidate result JSON."),
        metric: list[str] = typer.Option([], "--metric", help="Result key to compare; repeatable."),
        criterion: list[str] = typer.Option([], "--criterion", help="Gate on the B/A ratio, e.g. 'output_throughput>=0.95'."),
        confidence: float = typer.Option(0.95, "--confidence", help="Confidence of the intervals, in (0, 1)."),
        n_boot: int = typer.Option(2000, "--n-boot", help="Bootstrap replicates (>= 100)."),
        seed: int = typer.Option(0, "--seed"),
        process_noise: float = typer.Option(
            0.0, "--process-noise", min=0.0,
            help="Spread (sd of the log ratio) between two fresh server processes with the same settings, from an A/A "
                 "calibration (bench/ab_power.py reports it); widens the interval by it over the runs' restarts."),
        per_request: bool = typer.Option(
            False, "--per-request",
            help="With one run per side, show a bootstrap interval of latency metrics over the requests of those two "
                 "runs. It ignores between-run variance, so it decides nothing: one run per side stays inconclusive."),
        allow_mismatch: bool = typer.Option(
            False, "--allow-mismatch", help="Compare although A and B ran different workloads (warns with the differences)."),
        interval: str = typer.Option(
            "t", "--interval",
            help="t (default): geometric mean of the per-pair ratios with a t-interval on their logs, the interval the "
                 "loop decides on; bootstrap: a percentile bootstrap of the ratio of means (covers the truth less often "
                 "than it claims with few runs)."),
        as_json: bool = typer.Option(False, "--json"),
    ) -> None:
        """Per-metric ratio B/A with a confidence interval, and a verdict per criterion.

        The interval is the judge's: the geometric mean of the per-pair ratios of
        interleaved runs with a t-interval on their logs (--interval bootstrap opts in to a
        percentile bootstrap).  Fewer than 3 runs per side decide nothing: inconclusive."""
        with user_errors(as_json):
            from infra_agent.judge.verdict import (
                PER_REQUEST_LABEL,
                compare_runs,
                parse_gate,
                workload_mismatch,
            )

            _check_options(confidence, n_boot)
            if interval not in ("t", "bootstrap"):
                raise ConfigError("--interval", None, "t or bootstrap", interval)
            gates = [parse_gate(c) for c in criterion]
            runs_a, runs_b = read_runs(a, "A"), read_runs(b, "B")
            mismatch = workload_mismatch(runs_a, runs_b) + measurement_mismatch(runs_a, runs_b)
            if mismatch and not allow_mismatch:
                raise BenchmarkError(
                    f"{a} (A) and {b} (B) ran different workloads, so their numbers are not comparable:\n  "
                    + "\n  ".join(mismatch) + "\nrun both with the same workload, or pass --allow-mismatch to compare anyway")
            metrics = list(dict.fromkeys([*(metric or _default_metrics(runs_a, runs_b)), *(g.metric for g in gates)]))
            _check_metrics(a, "A", runs_a, metrics)
            _check_metrics(b, "B", runs_b, metrics)
            comp = compare_runs(runs_a, runs_b, metrics, gates, confidence=confidence, n_boot=n_boot, seed=seed,
                                process_noise=process_noise, per_request=per_request, interval=interval)
        warnings = []
        if mismatch:
            warnings.append("A and B ran different workloads (--allow-mismatch): " + "; ".join(mismatch))
        if any(mc.source == "per-request" for mc in comp.metrics):
            warnings.append(f"{PER_REQUEST_LABEL}: the intervals marked per-request come from the requests of one run "
                            "per side and say nothing about how much a repeated run would differ")
        result = {**comp.as_dict(), "a": str(a), "b": str(b), "per_request": per_request,
                  "workload_mismatch": mismatch, "warnings": warnings}
        emit(result, as_json, lambda console: render_comparison(comp, console, a, b, warnings))
        if as_json:
            for side, why in comp.failed.items():
                err_console.print(f"[bold red]{_SIDE[side]} failed:[/] {escape(why)}", highlight=False)
        if comp.failed or any(v.outcome == "fail" for v in comp.verdicts):
            raise typer.Exit(code=1)
