"""Helpers for the server tests, as fixtures (test folders are not packages here)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


def _scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, label sets summed away: ``{sample_name: value}``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _sse_events(lines: Iterable[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE stream, JSON-decoded except the final ``[DONE]``."""
    events: list[Any] = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture
def scrape() -> Callable[[str], dict[str, float]]:
    return _scrape


@pytest.fixture
def sse_events() -> Callable[[Iterable[str]], list[Any]]:
    return _sse_events
