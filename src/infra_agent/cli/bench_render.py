"""How one serving benchmark's result reads on a terminal: a metric table, then the
failure (if any) and where the result and the per-request records were written.

Separate from ``cli/bench.py``, which turns flags into a run: this module only reads
a finished result dict, so it needs neither the runner nor the workspace.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def render_result(result: dict[str, Any], console: Console, output: Path | None = None) -> None:
    if "completed" in result:
        _render_table(result, console)
    if not result.get("ok", True):
        console.print(Text.assemble(("run failed: ", "bold red"), str(result.get("error"))))
        if result.get("log_path"):
            console.print(f"log: {result['log_path']}", markup=False, highlight=False)
        if result.get("log_tail"):
            console.print("--- log tail ---", markup=False, highlight=False)
            console.print(result["log_tail"].rstrip(), markup=False, highlight=False)
    if output is not None:
        console.print(f"result written to {output}", markup=False, highlight=False)
    if result.get("requests_file"):
        console.print(f"per-request records in {result['requests_file']}", markup=False, highlight=False)


def _render_table(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"serving benchmark: {result.get('url')} ({result.get('endpoint')})", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = _throughput_rows(result) + _latency_rows(result) + _server_rows(result)
    if result.get("tokenizer_id"):
        check = f" ({result['tokenizer_check']})" if result.get("tokenizer_check") else ""
        rows.append(("prompt lengths counted by", f"{result['tokenizer_id']}{check}"))
    for name, value in rows:
        table.add_row(Text(name), Text(value))  # Text: "[ms]" is a unit, not rich markup
    console.print(table)
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        console.print(Text(f"{len(errors)} failed request(s); first: {errors[0]}", style="yellow"))
    if result.get("server_metrics_error"):
        console.print(Text(f"server metrics: {result['server_metrics_error']}", style="yellow"))


def _throughput_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("completed / failed", f"{result['completed']} / {result['failed']}"),
        ("duration [s]", f"{result['duration']:.2f}"),
        ("request throughput [req/s]", f"{result['request_throughput']:.3f}"),
        ("output throughput [tok/s]", f"{result['output_throughput']:.1f}"),
        ("total token throughput [tok/s]", f"{result['total_token_throughput']:.1f}"),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("request goodput [req/s]", f"{result['request_goodput']:.3f}"))
    return rows


def _latency_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """TTFT/TPOT/ITL/E2EL under the result's latency definition, then the other definition's beside."""
    rows: list[tuple[str, str]] = []
    pkeys = sorted({k.split("_", 1)[0] for k in result if re.match(r"^p[\d.]+_ttft_ms$", k)}, key=lambda s: float(s[1:]))
    definition = result.get("latency_definition", "vllm")
    for m in ("ttft", "tpot", "itl", "e2el"):
        parts = [f"mean {result[f'mean_{m}_ms']:.2f}", f"median {result[f'median_{m}_ms']:.2f}"]
        parts += [f"{p} {result[f'{p}_{m}_ms']:.2f}" for p in pkeys if p != "p50"]  # p50 is the median
        rows.append((f"{m.upper()} [ms]" + (f" ({definition})" if "latency_definition" in result else ""), "  ".join(parts)))
    for other in ("vllm", "content"):
        alt = result.get(f"{other}_latency")
        if other == definition or not isinstance(alt, dict):
            continue
        for m in ("ttft", "tpot", "itl"):
            rows.append((f"{m.upper()} [ms] ({other}, {alt.get('timed', 0)} req)",
                         f"mean {alt[f'mean_{m}_ms']:.2f}  median {alt[f'median_{m}_ms']:.2f}"))
    return rows


def _server_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per server phase whose Prometheus histogram was diffed over the run."""
    rows: list[tuple[str, str]] = []
    for phase, d in (result.get("server_metrics") or {}).items():
        if d.get("missing"):
            rows.append((f"server {phase}", "missing: no " + " or ".join(d.get("expected") or [])))
            continue
        mean = "reset" if d.get("reset") else ("-" if d["mean_s"] is None else f"{d['mean_s'] * 1e3:.2f}")
        rows.append((f"server {phase} mean [ms] (n)", f"{mean} ({d.get('count')})"))
    return rows
