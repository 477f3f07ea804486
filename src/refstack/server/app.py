"""The FastAPI app factory: engine, metrics and routes for one server.

``create_app`` builds everything (the model too) but starts nothing; the engine
thread starts and stops with the app's lifespan.  There is no module-level app.
The server-only knobs (``max_request_bytes``) are its keyword arguments; the engine's
are in ``config``.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from refstack.engine import EngineConfig
from refstack.engine.heap import freeze_heap, frozen_by_refstack
from refstack.engine.tracing_start import start_tracing
from refstack.knobs import knob
from refstack.server.errors import APIError, api_error_handler
from refstack.server.limits import BodySizeLimit
from refstack.server.logprobs import LogprobEngine
from refstack.server.metrics import EngineMetrics
from refstack.server.openai_routes import register_openai_routes
from refstack.server.profile_routes import register_profile_routes
from refstack.server.trace_routes import register_trace_routes
from refstack.tp.checks import check_tp, uses_tp

DEFAULT_MAX_REQUEST_BYTES: int = knob("max_request_bytes").default


def cache_info(engine: Any) -> dict[str, Any]:
    """The KV cache / KDA state storage and what it costs (``refstack.model.kv_dtypes.footprint``:
    KV bytes per token, KDA state bytes per sequence, sequences of max_seq_len per GiB), plus
    the cache's allocated bytes where this process holds it (not the disaggregated front end)."""
    from refstack.model.kv_dtypes import footprint, resolve_kv_dtypes

    cache = getattr(engine, "cache", None)
    if cache is not None and hasattr(cache, "footprint"):
        return {**cache.footprint(), "num_slots": cache.num_slots, "allocated_bytes": cache.nbytes}
    config, model_config = engine.config, engine.model.config
    kv = resolve_kv_dtypes(config.kv_cache_dtype, config.kv_cache_dtype_layers, model_config)
    return footprint(model_config, kv, config.kda_state_dtype, engine.max_seq_len)


def _tensor_parallel(config: EngineConfig, model: Any,
                     on_failure: Callable[[str], None] | None) -> tuple[EngineConfig, Any]:
    """The ranks (``refstack.tp``), started before the server listens; the config as the
    engine then sees it (the shards run torch's kernels: ``--cpu-kernels auto`` means torch)."""
    from refstack.engine.device import resolve_placement
    from refstack.tp.group import TPModel

    if model is not None:
        raise ValueError("create_app with --tp builds the shards in the ranks; pass no model")
    check_tp(config)
    config = config.with_overrides(cpu_kernels="torch")
    return config, TPModel(config, on_failure=on_failure, device=resolve_placement(config).device)


def create_app(config: EngineConfig, *, model: Any = None, tokenizer: Any = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, disagg: bool | str = False,
               on_failure: Callable[[str], None] | None = None) -> FastAPI:
    """Build a server app; ``model``/``tokenizer`` default to the config's preset.

    ``disagg``: serve through a prefill and a decode worker process (``refstack.disagg``),
    and with ``"epd"`` encode workers too (``refstack.encode.frontend``); they start here,
    and ``on_failure`` is called if one dies while serving."""
    start_tracing(config)  # in memory: /debug/trace serves it; INFRA_AGENT_TRACE adds the file
    model_name = f"refstack-{config.preset}"
    metrics = EngineMetrics(model_name)
    engine: Any
    tp_model: Any = None  # refstack.tp.group.TPModel under --tp
    if disagg:
        check_tp(config, disagg=True)  # TPConfigError: the workers are single-rank engines
        if model is not None or tokenizer is not None:
            raise ValueError("create_app(disagg=True) builds its models in the workers; pass no model or tokenizer")
        from refstack.disagg.frontend import DisaggEngine
        from refstack.engine.device import resolve_placement

        resolve_placement(config, disagg=True)  # PlacementError: the workers run on the CPU only
        if disagg == "epd":
            from refstack.encode.frontend import EPDEngine

            engine = EPDEngine(config, observer=metrics, on_failure=on_failure)
        else:
            engine = DisaggEngine(config, observer=metrics, on_failure=on_failure)
            # Its prefill worker gets no encoder input: images are served inline or with --disagg epd.
            engine.images_unsupported = "--disagg true has no encode stage; serve with --disagg epd"
    else:
        if uses_tp(config):
            config, tp_model = _tensor_parallel(config, model, on_failure)
            model = tp_model
        engine = LogprobEngine(config, model=model, tokenizer=tokenizer, observer=metrics)
        if tp_model is not None:  # the TP ranks' step takes no image embeddings
            engine.images_unsupported = "tensor parallelism (--tp) takes no image embeddings; serve with --tp 1"
    metrics.bind(engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if config.gc_freeze:
            # The server's own heap too (the web stack; with --disagg the front end has no
            # Engine of its own, and its full collections took 117-131 ms of the event loop).
            freeze_heap()
        try:
            yield
        finally:
            engine.stop()
            if tp_model is not None:
                tp_model.close()  # after the engine thread: the stop message is a collective

    app = FastAPI(title="refstack", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.add_exception_handler(APIError, api_error_handler)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    register_openai_routes(app, engine, model_name)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    register_trace_routes(app, config, engine if disagg else tp_model)
    register_profile_routes(app, engine, in_process=not disagg and tp_model is None)

    @app.get("/debug/engine")
    async def debug_engine() -> JSONResponse:
        return JSONResponse({
            "config": config.to_dict(),
            # What the "auto" knobs resolved to on this machine.
            "dtype": engine.dtype,
            "native_kernels": engine.native_kernels,
            "device": getattr(engine, "device", "cpu"),  # the disaggregated workers run on the CPU only
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "num_slots_used": engine.num_slots_used,
            "num_slots": config.slots,
            "max_seq_len": engine.max_seq_len,
            "cache": cache_info(engine),
            "server": {"max_request_bytes": max_request_bytes},
            # The collector's state in this process: what --gc-freeze froze, and how far each
            # generation is from its next collection.
            "gc": {"frozen_objects": gc.get_freeze_count(), "frozen_by_refstack": frozen_by_refstack(),
                   "counts": list(gc.get_count()),
                   "thresholds": list(gc.get_threshold())},
            "disagg": None if not disagg else {
                "kv_transfer": config.kv_transfer, "store_pid": engine.store.pid,
                "kv_transfer_granularity": config.kv_transfer_granularity, "kv_link_gbps": config.kv_link_gbps,
                "kv_link_compute_ratio": config.kv_link_compute_ratio,
                "workers": {role: w.proc.pid for role, w in engine.workers.items()}},
            "tp": None if tp_model is None else {
                "world": tp_model.world, "backend": tp_model.backend, "pids": tp_model.pids,
                "gemm_precision": tp_model.gemm_precision},
        })

    return app
