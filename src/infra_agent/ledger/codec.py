"""How models become ledger rows: one scrubbed JSON dump, and the rows derived from it.

Every value written to the ledger passes through :func:`clean` first, so a secret in a
hypothesis, a finding's evidence or a run's options never reaches the file (the ledger
outlives the run and is shared in reports and bug reports).  The derived rows are cut
from the *cleaned* dump, never from the model, so no path around the scrub exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from infra_agent.records import Experiment
from infra_agent.safety import scrub, secret_values

Row = tuple[Any, ...]
SIDES: tuple[tuple[str, str], ...] = (("candidate", "feedback"), ("baseline", "baseline_feedback"))


def clean(value: Any, extra: Iterable[str] = ()) -> Any:
    """``value`` (JSON-like data) passed through :func:`scrub`: every occurrence of a secret of
    the environment masked by value (mapping keys included, since free-form dicts such as
    evidence or state may be keyed by anything), and the secrets known by their form (a URL's
    password, a bearer token, a credential under a secret key).  Numbers are never touched: a
    knob ``max_num_batched_tokens`` stays 8192, so the record reads back and resumes as it was.
    """
    return scrub(value, secret_values(extra=extra))


def to_json(value: Any) -> str:
    """JSON text of already-cleaned data (NaN/inf kept: samples may hold them)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def dumps(value: Any, extra: Iterable[str] = ()) -> str:
    """Cleaned JSON text of any JSON-like value (``extra``: more secret values to mask)."""
    return to_json(clean(value, extra))


def experiment_row(exp: Experiment, data: dict[str, Any]) -> Row:
    """Values for the ``experiments`` columns, in table order (``data`` is the cleaned dump).

    The identity columns come from the model: ids are generated, not user text, and
    scrubbing one would make the experiment unreachable by its own id.
    """
    probe = data.get("probe")
    cost = data.get("cost") or {}
    tier = probe["tier"] if probe else cost.get("tier")
    return (
        exp.run_id,
        exp.id,
        exp.seq,
        exp.parent,
        exp.status,
        data.get("proposer", ""),
        probe["name"] if probe else None,
        tier,
        float(cost.get("wall_s") or 0.0),
        int(exp.accepted),
        exp.started_at,
        exp.finished_at,
        to_json(data),
    )


def measurement_rows(run_id: str, exp_id: str, data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for side, key in SIDES:
        fb = data.get(key)
        if not fb:
            continue
        for idx, m in enumerate(fb.get("measurements", [])):
            s = m.get("summary")
            rows.append((
                run_id, exp_id, side, idx, m["name"], m["unit"], to_json(m.get("tags", {})),
                s["median"] if s else None, s["ci_low"] if s else None, s["ci_high"] if s else None,
                s["n"] if s else 0, to_json(m.get("samples", [])),
            ))
    return rows


def finding_rows(run_id: str, exp_id: str, data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for side, key in SIDES:
        fb = data.get(key)
        if not fb:
            continue
        for idx, f in enumerate(fb.get("findings", [])):
            loc = f.get("location")
            rows.append((
                run_id, exp_id, side, idx, f["kind"], f.get("severity", "info"), f["message"],
                None if loc is None else to_json(loc), to_json(f.get("evidence", {})), f.get("next_question"),
            ))
    return rows


def artifact_rows(run_id: str, exp_id: str, data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for side, key in SIDES:
        fb = data.get(key)
        if not fb:
            continue
        for idx, a in enumerate(fb.get("artifacts", [])):
            rows.append((run_id, exp_id, side, idx, a["kind"], a["path"], a.get("description", "")))
    return rows
