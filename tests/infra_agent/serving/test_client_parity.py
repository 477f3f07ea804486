"""Client parity with vLLM's client: connections opened before the window, and the sampling
the requests asked for recorded in the result (a server on loopback that sees every connection)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from infra_agent.serving.runner import run_benchmark_async
from infra_agent.workspace.models import Scenario


class Recorder:
    """A minimal OpenAI-compatible streaming server that notes each request's connection and body."""

    def __init__(self) -> None:
        self.models_ports: set[int] = set()
        self.generation: list[tuple[int, dict[str, Any]]] = []

    @staticmethod
    def _port(request: web.Request) -> int:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return int(peer[1]) if peer else -1

    async def models(self, request: web.Request) -> web.Response:
        self.models_ports.add(self._port(request))
        await asyncio.sleep(0.02)  # long enough that concurrent calls need connections of their own
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.generation.append((self._port(request), body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for _ in range(n):
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": "a"}]}).encode() + b"\n\n")
            await asyncio.sleep(0.001)
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp


async def _serve_and_measure(scenario: Scenario) -> tuple[Recorder, dict[str, Any]]:
    rec = Recorder()
    app = web.Application()
    app.router.add_get("/v1/models", rec.models)
    app.router.add_post("/v1/completions", rec.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        result = await run_benchmark_async(f"http://127.0.0.1:{port}", scenario, model="m", progress=False)
    finally:
        await runner.cleanup()
    return rec, result


def _scenario(**extra: Any) -> Scenario:
    return Scenario.model_validate({"dataset": {"kind": "random", "input_len": 8, "output_len": 4, "seed": 0},
                                    "num_requests": 12, "max_concurrency": 6, "warmup_requests": 1, **extra})


def test_the_window_opens_no_connection_of_its_own() -> None:
    rec, result = asyncio.run(_serve_and_measure(_scenario()))
    assert result["ok"] and result["completed"] == 12
    assert result["connections_preopened"] == 6
    warm, timed = rec.generation[:1], rec.generation[1:]
    before = rec.models_ports | {p for p, _ in warm}
    assert len(rec.models_ports) >= 6  # concurrent: each on a connection of its own
    assert {p for p, _ in timed} <= before, "a timed request waited for a connect"


def test_the_sampling_asked_for_is_sent_and_recorded() -> None:
    rec, result = asyncio.run(_serve_and_measure(_scenario()))
    assert all(body["temperature"] == 0.0 for _, body in rec.generation)
    assert result["sampling"] == {"temperature": 0.0, "ignore_eos": True}
    rec, result = asyncio.run(_serve_and_measure(_scenario(temperature=None)))
    assert all("temperature" not in body for _, body in rec.generation)  # vLLM's client: the server's default
    assert result["sampling"]["temperature"] == "server default"
