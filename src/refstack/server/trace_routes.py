"""``/debug/trace``: the trace so far, and switching tracing on and off in a running server.

``GET /debug/trace`` serves the Chrome trace (``?reset=true`` clears it).
``POST /debug/trace/start`` (``?level=layer|step``, ``?reset=true``) and ``POST
/debug/trace/stop`` switch the tracer on and off without a restart, the way vLLM's and
SGLang's ``/start_profile`` and ``/stop_profile`` drive their profilers: an agent can
trace one window of a live server, and a benchmark can compare traced and untraced
requests on one process (``bench/tracer_overhead.py``), free of the offset between two
processes.  A stopped trace stays readable until the next reset.

With ``--disagg`` or ``--tp`` the workers' tracers start with their processes, so the
switch is refused there (409): start those servers with ``--trace true``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from infra_agent import tracing
from refstack.engine import EngineConfig
from refstack.server.errors import APIError


def register_trace_routes(app: FastAPI, config: EngineConfig, workers: Any = None) -> None:
    """The trace routes; ``workers``: what holds the other processes' traces (the
    disaggregated engine or the TP group, with ``worker_traces(reset)``), else None."""
    state = {"started": tracing.is_enabled()}  # whether this process has traced: a stopped trace is still served

    @app.get("/debug/trace")
    async def debug_trace(reset: bool = False) -> JSONResponse:
        """The Chrome trace so far; ``?reset=true`` clears it.  409 while tracing has never been on."""
        if not tracing.is_enabled() and not state["started"]:
            # 409: the endpoint exists, but the server's state (tracing off) keeps it from answering.
            raise APIError(409, "tracing is off, so there is no trace to serve: start the server with "
                           "--trace true (or INFRA_AGENT_TRACE=path, which also writes the trace at exit), "
                           "or POST /debug/trace/start", code="tracing_disabled")
        snap = tracing.snapshot()
        if reset:
            tracing.reset()
        # The workers' (--disagg) or the other ranks' (--tp) spans too, shifted onto this
        # process's span clock (all are perf_counter).
        if workers is not None:
            origin = tracing.get_tracer().origin_perf_ns
            for worker_snap, worker_origin in await asyncio.to_thread(workers.worker_traces, reset):
                shift_us = (worker_origin - origin) / 1000.0
                for ev in worker_snap["traceEvents"]:
                    if "ts" in ev:
                        ev["ts"] += shift_us
                    snap["traceEvents"].append(ev)
        return JSONResponse(snap)

    def refuse_with_workers(action: str) -> None:
        if workers is not None:
            raise APIError(409, f"cannot {action} tracing at run time with --disagg or --tp: the worker processes' "
                           "tracers start with them; start the server with --trace true", code="tracing_toggle_unsupported")

    @app.post("/debug/trace/start")
    async def debug_trace_start(level: str | None = None, reset: bool = False) -> JSONResponse:
        """Switch tracing on (``level``: the ``--trace-level`` knob's default when absent)."""
        refuse_with_workers("start")
        chosen = level or config.trace_level
        if chosen not in tracing.LEVELS:
            raise APIError(400, f"level={chosen!r}: expected one of {sorted(tracing.LEVELS)}", param="level",
                           code="invalid_trace_level")
        if reset:
            tracing.reset()
        tracing.enable(level=chosen)
        state["started"] = True
        return JSONResponse({"tracing": True, "level": chosen})

    @app.post("/debug/trace/stop")
    async def debug_trace_stop() -> JSONResponse:
        """Switch tracing off; what it recorded stays readable at ``GET /debug/trace``."""
        refuse_with_workers("stop")
        tracing.disable()
        return JSONResponse({"tracing": False, "level": tracing.get_tracer().level})
