"""``/start_profile`` and ``/stop_profile``: torch.profiler on the engine's loop thread of a
running server, under the names vLLM and SGLang give these endpoints.

torch.profiler records the CPU ops of the thread that starts it, so the profiler is
started and stopped on the ``engine-loop`` thread, between two steps
(``Engine.call_on_loop``); CUDA activity is recorded too when the engine runs on a GPU.
``POST /stop_profile`` writes the Kineto trace (Chrome trace JSON, which
``infra-agent trace analyze`` reads beside our spans) into ``output_dir`` as given to
``/start_profile`` (default: ``refstack-profile`` in the system's temp directory) and
answers its path; ``?export=false`` drops it instead (a benchmark timing the profiler
itself).  With ``--disagg`` or ``--tp`` the engines run in other processes: refused (409).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from refstack.server.errors import APIError


class _Profiling:
    """The profiler in flight, if any; ``lock`` serialises start and stop (an asyncio lock:
    it is held across the awaits that run them on the engine's thread)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.prof: Any = None
        self.output_dir: Path | None = None
        self.count = 0


def _activities(engine: Any) -> list[Any]:
    import torch
    from torch.profiler import ProfilerActivity

    on_gpu = torch.cuda.is_available() and str(getattr(engine, "device", "cpu")).startswith("cuda")
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]


def register_profile_routes(app: FastAPI, engine: Any, in_process: bool) -> None:
    """The profile routes; ``in_process``: the engine's loop thread is in this process
    (not ``--disagg`` or ``--tp``)."""
    state = _Profiling()

    def refuse_elsewhere() -> None:
        if not in_process:
            raise APIError(409, "torch.profiler runs on the thread that runs the model, which with --disagg or --tp "
                           "is in another process: profile a single-process server", code="profiling_unsupported")

    @app.post("/start_profile")
    async def start_profile(output_dir: str | None = None) -> JSONResponse:
        """Start torch.profiler on the engine's loop thread; 409 if it is already on."""
        refuse_elsewhere()
        async with state.lock:
            if state.prof is not None:
                raise APIError(409, "the profiler is already on: POST /stop_profile first", code="profiling_active")
            target = Path(output_dir) if output_dir else Path(tempfile.gettempdir()) / "refstack-profile"

            def start() -> Any:
                from torch.profiler import profile

                prof = profile(activities=_activities(engine), record_shapes=False, with_stack=False)
                prof.start()
                return prof

            state.prof = await asyncio.to_thread(engine.call_on_loop, start)
            state.output_dir = target
        return JSONResponse({"profiling": True, "output_dir": str(target)})

    @app.post("/stop_profile")
    async def stop_profile(export: bool = True) -> JSONResponse:
        """Stop the profiler; write its trace (``export``) and answer its path and event count."""
        refuse_elsewhere()
        async with state.lock:
            prof, state.prof = state.prof, None
            if prof is None:
                raise APIError(409, "the profiler is not on: POST /start_profile first", code="profiling_inactive")
            await asyncio.to_thread(engine.call_on_loop, prof.stop)
            if not export:
                return JSONResponse({"profiling": False, "trace": None})
            assert state.output_dir is not None
            state.count += 1
            path = state.output_dir / f"refstack-{os.getpid()}-{state.count}.pt.trace.json"

            def write() -> int:
                path.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(path))
                return len(prof.events())

            try:
                events = await asyncio.to_thread(write)
            except OSError as exc:
                raise APIError(500, f"the profile could not be written to {path}: {exc}", code="profile_write_failed") \
                    from exc
        return JSONResponse({"profiling": False, "trace": str(path), "events": events})
