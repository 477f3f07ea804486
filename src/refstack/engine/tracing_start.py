"""Tracing as a refstack process turns it on: ``--trace`` at ``--trace-level``, and the
trace file of a process started by another (a disaggregated worker, a TP rank)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from infra_agent import tracing

if TYPE_CHECKING:
    from refstack.engine.config import EngineConfig


def start_tracing(config: EngineConfig, child: str | None = None) -> None:
    """Switch tracing on as ``config`` asks.  A tracer already on through
    ``INFRA_AGENT_TRACE`` keeps ``INFRA_AGENT_TRACE_LEVEL``.  ``child`` names a process
    started by the server: it writes its own file (``PATH`` -> ``PATH-stem.CHILD.json``),
    never its parent's."""
    if child is not None:
        path = os.environ.pop("INFRA_AGENT_TRACE", None)
        if path:
            root, ext = os.path.splitext(path)
            os.environ["INFRA_AGENT_TRACE"] = f"{root}.{child}{ext or '.json'}"
    if config.trace and not tracing.is_enabled():
        tracing.enable(level=config.trace_level)
