"""The end-to-end window of bench/tracer_overhead.py: a client's throughput through one
``refstack serve`` whose tracing is switched on and off between calls
(``POST /debug/trace/start|stop``).

The engine-level window (the worker in tracer_overhead.py) times ``Engine.generate`` in
one process: the strictest denominator, since it leaves out everything a request costs
besides the step.  This one is what the issue's "E2E throughput" names: requests over
HTTP to a server, as a user runs it with ``--trace true``, the tokens the client got
over the client's wall time.  One server takes every tracing setting, call by call in
rotated order (as the paired engine window does), because two server processes differ by
more than the 2% asked about (bench/ab_power.py).  torch.profiler runs on a second server
(``POST /start_profile`` / ``/stop_profile``, on the engine's thread) in whole windows
against that server's own tracing-off windows (``whole``), as the engine window's
profiler worker does: its first use grows the heap for good.

A call is ``batch`` concurrent non-streaming completions of ``prompt_len`` token ids
and ``gen_len`` tokens each (``ignore_eos``, greedy): the engine window's batch.  Not
streamed, so the server's per-token work is the least it can be and tracing's share the
largest.  The server runs the engine window's knobs (``--max-running``,
``--prefill-chunk``, ``--max-batch-tokens``, ``--torch-threads``).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from infra_agent.target.server import ServerProcess
from infra_agent.workspace.models import ServerTargetSpec

# setting -> the switch before a call: (path, params) of the POST
SWITCH = {"off": ("/debug/trace/stop", {}), "tracing": ("/debug/trace/start", {"level": "layer"}),
          "tracing_step": ("/debug/trace/start", {"level": "step"})}


class E2EWindow:
    """A server and a client for paired end-to-end windows (``run``)."""

    def __init__(self, preset: str, batch: int, prompt_len: int, gen_len: int, torch_threads: int) -> None:
        self.batch, self.gen_len = batch, gen_len
        spec = ServerTargetSpec(
            kind="server",
            command=[sys.executable, "-m", "refstack.cli", "serve", "--preset", preset, "--port", "{port}",
                     "--max-running", str(batch), "--prefill-chunk", str(prompt_len),
                     "--max-batch-tokens", str(batch * prompt_len), "--torch-threads", str(torch_threads),
                     "--log-level", "error"],
            ready_url="/health", ready_timeout_s=180)
        self._logs = tempfile.TemporaryDirectory(prefix="tracer-overhead-e2e-")
        self.server = ServerProcess(spec, {}, Path(self._logs.name), name="refstack")
        # The engine window's prompts: the same token ids, sent as ids (no tokenizer in the way).
        self.prompts = [[(31 * b + 7 * i) % 256 for i in range(prompt_len)] for b in range(batch)]
        self.loop = asyncio.new_event_loop()
        self.client: httpx.AsyncClient | None = None

    def start(self) -> E2EWindow:
        self.server.start()
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=120)
        return self

    def close(self) -> None:
        try:
            if self.client is not None:
                self.loop.run_until_complete(self.client.aclose())
            self.loop.close()
        finally:
            self.server.stop()
            self._logs.cleanup()

    async def _call(self) -> float:
        assert self.client is not None
        body = {"max_tokens": self.gen_len, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(self.client.post("/v1/completions", json={**body, "prompt": p})
                                         for p in self.prompts))
        wall = time.perf_counter() - t0
        for r in replies:
            r.raise_for_status()
            got = r.json()["usage"]["completion_tokens"]
            if got != self.gen_len:  # the tokens/s below assume every call made them all
                raise RuntimeError(f"E2E window: a completion made {got} tokens, not {self.gen_len}")
        return wall

    async def _switch(self, setting: str) -> None:
        assert self.client is not None
        path, params = SWITCH[setting]
        (await self.client.post(path, params=params)).raise_for_status()

    def calibrate(self, window_s: float) -> int:
        """Calls per window for about ``window_s`` with tracing off (after a warm-up)."""
        async def go() -> int:
            await self._switch("off")
            for _ in range(2):
                await self._call()
            per_call = statistics.median([await self._call() for _ in range(3)])
            return max(1, round(window_s / per_call))
        return self.loop.run_until_complete(go())

    def warm_profiler(self) -> None:
        """One profiled call, its trace dropped: torch.profiler's first-use costs (its
        initialisation, the objects it leaves in the heap for good) out of the windows."""
        async def go() -> None:
            assert self.client is not None
            (await self.client.post("/start_profile")).raise_for_status()
            await self._call()
            (await self.client.post("/stop_profile", params={"export": "false"})).raise_for_status()
        self.loop.run_until_complete(go())

    def whole(self, calls: int, setting: str) -> dict[str, Any]:
        """A whole window of ``calls`` calls, tracing off, and for ``torch_profiler`` the
        server's torch.profiler on for all of them (``POST /start_profile`` before,
        ``/stop_profile`` after: its time is ``post_s``), as a profiler is used: one window
        profiled, then stopped.  Not paired call by call as tracing is, because starting
        and stopping Kineto around each call would measure its start-up, not its cost."""
        async def go() -> dict[str, Any]:
            assert self.client is not None
            await self._switch("off")
            if setting == "torch_profiler":
                (await self.client.post("/start_profile")).raise_for_status()
            wall = 0.0
            for _ in range(calls):
                wall += await self._call()
            t0 = time.perf_counter()
            if setting == "torch_profiler":
                (await self.client.post("/stop_profile", params={"export": "false"})).raise_for_status()
            return {"setting": setting, "wall_s": wall, "post_s": time.perf_counter() - t0,
                    "tokens_per_s": calls * self.batch * self.gen_len / wall}
        return self.loop.run_until_complete(go())

    def run(self, calls: int, settings: list[str]) -> dict[str, Any]:
        """``calls`` rounds of one call per setting, the order rotated each round; then the
        trace fetched (what the timeline probe does after its window) and cleared."""
        async def go() -> dict[str, Any]:
            assert self.client is not None
            walls: dict[str, list[float]] = {s: [] for s in settings}
            for i in range(calls):
                k = i % len(settings)
                for setting in settings[k:] + settings[:k]:
                    await self._switch(setting)
                    walls[setting].append(await self._call())
            await self._switch("off")
            t0 = time.perf_counter()
            (await self.client.get("/debug/trace", params={"reset": "true"})).raise_for_status()
            return {"setting": "e2e", "walls": walls, "post_s": time.perf_counter() - t0}
        return self.loop.run_until_complete(go())
