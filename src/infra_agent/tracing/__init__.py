"""Thread-aware span tracing that writes Chrome trace JSON (Perfetto opens it).

Off by default.  ``INFRA_AGENT_TRACE=path`` switches it on for the process (the file
is written at exit); ``enable()`` switches it on programmatically.  While off, a span
costs one small allocation and one attribute check.  ``INFRA_AGENT_TRACE_LEVEL=step``
(or ``enable(level="step")``) leaves out the per-layer spans for a cheaper trace.

    from infra_agent import tracing

    with tracing.span("prefill", cat="engine", tokens=128):
        ...

    @tracing.span("sample", cat="engine")
    def sample(...): ...

This is the one module refstack imports from infra_agent.
"""

from __future__ import annotations

from infra_agent.tracing.recorder import (
    LEVELS,
    RecordLayout,
    Tracer,
    disable,
    dump,
    enable,
    get_tracer,
    instant,
    int_sink,
    is_enabled,
    records,
    register_layout,
    reset,
    snapshot,
    span,
)

__all__ = [
    "LEVELS",
    "RecordLayout",
    "Tracer",
    "disable",
    "dump",
    "enable",
    "get_tracer",
    "instant",
    "int_sink",
    "is_enabled",
    "records",
    "register_layout",
    "reset",
    "snapshot",
    "span",
]
