"""Tracing: Chrome trace JSON with the named spans on the right threads, from
/debug/trace while running and from the INFRA_AGENT_TRACE file at exit."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

ENGINE_SPANS = {"engine.step", "schedule", "prefill", "decode", "sample"}
MODEL_SPANS = {"model.forward", "attention", "kda", "moe.dispatch", "moe.combine", "lm_head"}


def spans_by_thread(trace: dict[str, Any]) -> dict[str, set[str]]:
    """{thread name: {event names}}, after checking the events are well-formed Chrome trace."""
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    out: dict[str, set[str]] = defaultdict(set)
    for e in events:
        if e["ph"] == "M":
            continue
        assert e["ph"] in ("X", "i") and isinstance(e["ts"], (int, float)) and e["pid"] and e["tid"] in names
        if e["ph"] == "X":
            assert e["dur"] >= 0
        out[names[e["tid"]]].add(e["name"])
    return out


def drive(url: str) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "trace me", "max_tokens": 4, "stream": True, "ignore_eos": True}
            await asyncio.gather(*(client.post(url + "/v1/completions", json={**body, "seed": i}) for i in range(3)))

    asyncio.run(go())


def check(trace: dict[str, Any]) -> None:
    threads = spans_by_thread(trace)
    assert ENGINE_SPANS | MODEL_SPANS <= threads["engine-loop"], threads.get("engine-loop")
    assert {"http.submit", "http.done"} <= threads["MainThread"]
    # The engine's work happens on its own thread only.
    others = set().union(*(names for t, names in threads.items() if t != "engine-loop"))
    assert not (ENGINE_SPANS | MODEL_SPANS) & others
    steps = [e for e in trace["traceEvents"] if e["name"] == "engine.step"]
    for e in trace["traceEvents"]:
        if e["name"] in ("prefill", "decode", "sample"):  # nested inside some step
            assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3 for s in steps)


def test_trace_via_endpoint_and_file_at_exit(refstack_server_factory: Any, tmp_path: Path) -> None:
    path = tmp_path / "refstack.trace.json"
    server = refstack_server_factory(env={"INFRA_AGENT_TRACE": str(path)})
    drive(server.url)
    live = httpx.get(server.url + "/debug/trace").json()
    json.dumps(live)  # plain JSON all the way down
    check(live)
    assert server.stop() == 0  # SIGTERM: a clean exit, which writes the file
    on_disk = json.loads(path.read_text())
    check(on_disk)
    assert sum(e["name"] == "engine.step" for e in on_disk["traceEvents"]) >= \
        sum(e["name"] == "engine.step" for e in live["traceEvents"])


def test_trace_knob_at_layer_level_keeps_every_span_in_memory_and_reset_clears(refstack_server_factory: Any) -> None:
    server = refstack_server_factory(["--trace", "true", "--trace-level", "layer"])
    drive(server.url)
    trace = httpx.get(server.url + "/debug/trace", params={"reset": "true"}).json()
    check(trace)
    assert trace["otherData"]["level"] == "layer"
    after = httpx.get(server.url + "/debug/trace").json()
    assert not [e for e in after["traceEvents"] if e.get("name") == "engine.step"]


def test_trace_knob_keeps_the_step_spans_only_by_default(refstack_server_factory: Any) -> None:
    """``--trace true`` alone records at the ``step`` level (the one cheap enough to
    leave on): the engine's step spans with their shapes and the HTTP instants, no
    per-layer or model spans, and the level written in the trace."""
    server = refstack_server_factory(["--trace", "true"])
    drive(server.url)
    trace = httpx.get(server.url + "/debug/trace").json()
    threads = spans_by_thread(trace)
    assert ENGINE_SPANS <= threads["engine-loop"], threads.get("engine-loop")
    assert not MODEL_SPANS & threads["engine-loop"]
    assert {"http.submit", "http.done"} <= threads["MainThread"]
    assert trace["otherData"]["level"] == "step"
    decode = [e for e in trace["traceEvents"] if e["name"] == "decode"]
    assert decode and all(e["args"]["batch"] >= 1 and e["args"]["generated"] >= 1 for e in decode)


def test_tracing_starts_and_stops_at_run_time(refstack_server_factory: Any) -> None:
    """``POST /debug/trace/start|stop`` on a server started without tracing: nothing to
    serve before, the level asked for while on, nothing recorded once stopped, and the
    stopped trace still served; a bad level is refused and leaves tracing off."""
    server = refstack_server_factory()
    assert httpx.get(server.url + "/debug/trace").status_code == 409
    bad = httpx.post(server.url + "/debug/trace/start", params={"level": "kernel"})
    assert bad.status_code == 400 and "level='kernel'" in bad.json()["error"]["message"]
    assert httpx.get(server.url + "/debug/trace").status_code == 409  # still off
    started = httpx.post(server.url + "/debug/trace/start")  # the server's own level: step, the knob's default
    assert started.status_code == 200 and started.json() == {"tracing": True, "level": "step"}
    drive(server.url)
    assert httpx.post(server.url + "/debug/trace/stop").json()["tracing"] is False
    traced = httpx.get(server.url + "/debug/trace").json()
    threads = spans_by_thread(traced)
    assert ENGINE_SPANS <= threads["engine-loop"] and not MODEL_SPANS & threads["engine-loop"]
    steps = sum(e["name"] == "engine.step" for e in traced["traceEvents"])
    drive(server.url)  # stopped: these steps leave nothing
    assert sum(e["name"] == "engine.step" for e in httpx.get(server.url + "/debug/trace").json()["traceEvents"]) == steps
    # On again at the level asked for (layer: every span), the old trace cleared.
    assert httpx.post(server.url + "/debug/trace/start", params={"reset": "true", "level": "layer"}).json()["level"] == "layer"
    drive(server.url)
    check(httpx.get(server.url + "/debug/trace").json())
