"""Per-phase server metrics: Prometheus histograms scraped before and after a window.

A histogram's ``_sum`` and ``_count`` only grow, so (after − before) is exactly what
the requests of the window added: mean seconds per request in each phase, and how many
requests the server counted.  vLLM and refstack expose the same histogram names under
the ``vllm:`` and ``refstack:`` prefixes; label sets (model name, engine id) are summed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from infra_agent.errors import TargetError

PREFIXES = ("vllm:", "refstack:")

# phase -> histogram base name (without prefix or _sum/_count)
PHASES: dict[str, str] = {
    "queue": "request_queue_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
    "inference": "request_inference_time_seconds",
    "ttft": "time_to_first_token_seconds",
    "tpot": "time_per_output_token_seconds",
    "itl": "inter_token_latency_seconds",
    "e2e": "e2e_request_latency_seconds",
}

Snapshot = dict[str, float]  # "<name>_sum" / "<name>_count" -> value, summed over labels


def parse_histogram_totals(text: str) -> Snapshot:
    """Sum every ``*_sum`` and ``*_count`` sample of the exposition text over its labels."""
    totals: Snapshot = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name.endswith(("_sum", "_count")):
                totals[name] = totals.get(name, 0.0) + float(sample.value)
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


def phase_deltas(before: Snapshot, after: Snapshot) -> dict[str, dict[str, Any]]:
    """Per phase: the metric used, requests counted in the window, total and mean seconds.

    Phases whose histogram the server does not expose are left out.
    """
    out: dict[str, dict[str, Any]] = {}
    for phase, base in PHASES.items():
        for prefix in PREFIXES:
            name = prefix + base
            if name + "_count" not in after:
                continue
            count = after[name + "_count"] - before.get(name + "_count", 0.0)
            total = after.get(name + "_sum", 0.0) - before.get(name + "_sum", 0.0)
            # A negative delta means the server restarted inside the window; the numbers
            # would be meaningless, so say so instead of reporting them.
            if count < 0 or total < -1e-9:
                out[phase] = {"metric": name, "count": None, "sum_s": None, "mean_s": None, "reset": True}
            else:
                out[phase] = {
                    "metric": name,
                    "count": int(round(count)),
                    "sum_s": total,
                    "mean_s": total / count if count > 0 else None,
                }
            break
    return out
