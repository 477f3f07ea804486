"""Per-phase server metrics: Prometheus histograms scraped before and after a window.

A histogram's ``_sum`` and ``_count`` only grow, so (after − before) is exactly what
the requests of the window added: mean seconds per request in each phase, and how many
requests the server counted.  Label sets (model name, engine index) are summed.

Each stack names its histograms its own way (``phases.py`` maps vLLM's, SGLang's and
refstack's onto one set of phases).  The stack is recognised from the names in the
scrape; a phase that stack exports but the scrape lacks is reported as missing, with
the names looked for, never dropped silently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from infra_agent.errors import TargetError
from infra_agent.serving.phases import (
    PHASE_ORDER,
    SELECTOR_LABELS,
    STACKS,
    detect_stack,
)

Snapshot = dict[str, float]  # "<name>_sum" / "<name>_count" -> value, summed over labels


def parse_histogram_totals(text: str) -> Snapshot:
    """Sum every ``*_sum`` and ``*_count`` sample of the exposition text over its labels.

    A sample with a selector label (SGLang's ``stage``) is also summed under
    ``<name>{stage="<value>"}_sum``, so one stage of a shared histogram can be a phase.
    """
    totals: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            for suffix in ("_sum", "_count"):
                if not name.endswith(suffix):
                    continue
                value = float(sample.value)
                totals[name] = totals.get(name, 0.0) + value
                base = name[: -len(suffix)]
                for label in SELECTOR_LABELS:
                    if label in sample.labels:
                        key = f'{base}{{{label}="{sample.labels[label]}"}}{suffix}'
                        totals[key] = totals.get(key, 0.0) + value
    return totals


async def scrape(client: aiohttp.ClientSession, metrics_url: str, headers: Mapping[str, str] | None = None) -> Snapshot:
    try:
        async with client.get(metrics_url, headers=headers) as resp:
            status = resp.status
            text = await resp.text(errors="replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise TargetError(f"cannot scrape Prometheus metrics at {metrics_url}: {exc or type(exc).__name__}") from exc
    if status != 200:
        raise TargetError(f"Prometheus metrics at {metrics_url} answered HTTP {status}")
    try:
        return parse_histogram_totals(text)
    except ValueError as exc:
        raise TargetError(f"{metrics_url} is not Prometheus text exposition: {exc}") from exc


def _delta(name: str, before: Snapshot, after: Snapshot) -> dict[str, Any]:
    count = after[name + "_count"] - before.get(name + "_count", 0.0)
    total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
    # A negative delta means the server restarted inside the window; the numbers
    # would be meaningless, so say so instead of reporting them.
    if count < 0 or total < -1e-9:
        return {"metric": name, "count": None, "sum_s": None, "mean_s": None, "reset": True}
    return {"metric": name, "count": int(round(count)), "sum_s": total, "mean_s": total / count if count > 0 else None}


def phase_deltas(before: Snapshot, after: Snapshot) -> dict[str, dict[str, Any]]:
    """Per phase: the metric used, requests counted in the window, total and mean seconds.

    Phases the recognised stack does not export at all are left out (refstack has no
    ITL histogram); a phase it does export but the scrape lacks is
    ``{"metric": None, "missing": True, "expected": [names], ...}``.  A scrape with no
    histogram of a known stack gives ``{}``.
    """
    stack = detect_stack(after)
    if stack is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for phase in PHASE_ORDER:
        names = STACKS[stack].get(phase)
        if not names:
            continue
        found = next((n for n in names if n + "_count" in after), None)
        if found is None:
            out[phase] = {"metric": None, "count": None, "sum_s": None, "mean_s": None, "missing": True,
                          "expected": list(names)}
        else:
            out[phase] = _delta(found, before, after)
    return out


def missing_phases(deltas: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The phases a result reports as missing, in phase order."""
    return [p for p, d in deltas.items() if d.get("missing")]
