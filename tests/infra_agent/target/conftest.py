"""Servers for lifecycle tests, and a safety net that kills any group a failed test leaves."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from infra_agent.target import group_members


@pytest.fixture
def reap() -> Iterator[list[int]]:
    """Tests append every pgid they start; leftovers are killed so no test run leaks orphans."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        if group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
