"""Result files: write one run, read one or many runs back, and the failed-run record.

A file holds one vLLM-style result object, a list of them, or ``{"runs": [...]}``; a
failed run (``ok: false``) stays in the file beside the good ones so a crash late in a
series does not erase what was measured before it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infra_agent.errors import BenchmarkError


def failed_result(error: str, log_tail: str = "", log_path: str | None = None) -> dict[str, Any]:
    """A run that produced no trustworthy numbers; kept in result files beside good runs."""
    return {"ok": False, "error": error, "log_tail": log_tail, "log_path": log_path,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_result(result: dict[str, Any] | list[dict[str, Any]], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1) + "\n")


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    """The runs in a result file: one result, a list of results, or ``{"runs": [...]}``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchmarkError(f"{p}: not a readable result JSON ({exc})") from exc
    runs = data["runs"] if isinstance(data, dict) and "runs" in data else data if isinstance(data, list) else [data]
    if not runs or not all(isinstance(r, dict) for r in runs):
        raise BenchmarkError(f"{p}: expected a benchmark result object, a list of them, or {{'runs': [...]}}")
    return runs
