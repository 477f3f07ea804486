"""Disaggregated serving over HTTP: the same tokens as one engine, spans on their threads,
no orphans, and a dying worker takes the server down."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

# Prompts of several lengths: one past a KV page, one over prefill_chunk (two prefill
# steps), one of a single token's worth of text, one chat.
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 3, "x" * 300, "é€😀 mixed bytes"]
FLAGS = ("--max-seq-len", "384", "--dtype", "float32")


def _complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _answers(url: str) -> list[Any]:
    out = []
    for prompt in PROMPTS:
        choice = _complete(url, prompt)["choices"][0]
        out.append((choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]))
    # Seeded sampling: the sampler's generator state travels with the pages.
    choice = _complete(url, "seeded", temperature=0.9, seed=1234, logprobs=None)["choices"][0]
    out.append((choice["text"], None, choice["finish_reason"]))
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 10, "temperature": 0, "stream": True})
    events = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
    out.append(("".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]), None, None))
    return out


@pytest.fixture(scope="module")
def baseline(refstack_module_server_factory: Any) -> list[Any]:
    return _answers(refstack_module_server_factory(FLAGS).url)


@pytest.mark.parametrize("kv_transfer", ["true", "false"])
def test_disagg_gives_the_tokens_of_one_engine(baseline: list[Any], refstack_module_server_factory: Any,
                                               kv_transfer: str) -> None:
    server = refstack_module_server_factory([*FLAGS, "--disagg", "true", "--kv-transfer", kv_transfer,
                                             "--kv-page-tokens", "8", "--trace", "true",
                                             "--trace-level", "layer"])
    assert _answers(server.url) == baseline
    info = httpx.get(server.url + "/debug/engine", timeout=10).json()
    assert info["disagg"]["kv_transfer"] == (kv_transfer == "true")
    # torch.profiler runs on the thread that runs the model: in another process here.
    refused = httpx.post(server.url + "/start_profile", timeout=10)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "profiling_unsupported"
    # Concurrent requests: several handoffs in flight at once, all complete.
    with httpx.Client(timeout=120) as client:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(client.post, server.url + "/v1/completions",
                                json={"prompt": f"request {i} " * (i + 1), "max_tokens": 6, "ignore_eos": True})
                    for i in range(6)]
            assert all(f.result().status_code == 200 for f in futs)
    trace = httpx.get(server.url + "/debug/trace", timeout=30).json()["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    spans = {(e["name"], e["cat"], threads.get((e["pid"], e["tid"]))) for e in trace if e.get("ph") == "X"}
    kv_span = ("kv.transfer", "kv", "kv-transfer") if kv_transfer == "true" else ("kv.put_bulk", "kv", "engine-loop")
    for expected in [kv_span, ("kv.receive", "kv", "kv-receive"), ("ep.dispatch", "ep", "engine-loop"),
                     ("ep.combine", "ep", "engine-loop"), ("prefill", "engine", "engine-loop")]:
        assert expected in spans, expected
    pids = {e["pid"] for e in trace}
    assert len(pids) == 3  # the front end and both workers
    # The workers' tracers start with them: no switching at run time, said as such.
    refused = httpx.post(server.url + "/debug/trace/stop", timeout=10)
    assert refused.status_code == 409 and "--disagg" in refused.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "refstack:request_success_total" in metrics


@pytest.mark.slow
def test_a_dying_worker_stops_the_server_and_leaves_no_orphans(refstack_server_factory: Any) -> None:
    server = refstack_server_factory([*FLAGS, "--disagg", "true"])
    info = httpx.get(server.url + "/debug/engine", timeout=10).json()["disagg"]
    children = [info["store_pid"], *info["workers"].values()]
    os.kill(info["workers"]["prefill"], signal.SIGKILL)
    assert server.proc.wait(30) == 1
    assert "the prefill process died" in server.log()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in children):
        time.sleep(0.1)
    assert not any(_alive(p) for p in children)


@pytest.mark.slow
def test_sigterm_stops_every_process(refstack_server_factory: Any) -> None:
    server = refstack_server_factory([*FLAGS, "--disagg", "true"])
    info = httpx.get(server.url + "/debug/engine", timeout=10).json()["disagg"]
    children = [info["store_pid"], *info["workers"].values()]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert not any(_alive(p) for p in children)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent, the server, may not have reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False
