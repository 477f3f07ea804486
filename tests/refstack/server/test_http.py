"""The real server over HTTP: OpenAI shapes, streaming, concurrency, metrics, error bodies."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
          "time_to_first_token_seconds", "e2e_request_latency_seconds")


def test_health_and_models(refstack_server: Any) -> None:
    assert httpx.get(refstack_server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(refstack_server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "refstack-tiny"


def test_completion_non_streaming_with_usage(refstack_server: Any) -> None:
    body = {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = httpx.post(refstack_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "length"
    assert isinstance(out["choices"][0]["text"], str)
    # Byte-level tokenizer with a BOS: 1 + 11 bytes.
    assert out["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def test_chat_streaming_matches_non_streaming(refstack_server: Any, sse_events: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    whole = httpx.post(refstack_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    with httpx.stream("POST", refstack_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]  # include_usage chunk
    assert whole["usage"]["completion_tokens"] == 6
    # One content event per generated token (empty text for a byte that is not a whole
    # character yet), so clients can time every inter-token gap.
    assert len([c for c in chunks[1:] if c["choices"] and not c["choices"][0]["finish_reason"]]) == 6
    assert text == whole["choices"][0]["message"]["content"]
    assert whole["choices"][0]["message"]["role"] == "assistant"


def test_concurrent_streams_match_solo_runs_and_move_the_metrics(refstack_server: Any, scrape: Any,
                                                                  sse_events: Any) -> None:
    url = refstack_server.url
    prompts = [f"Request number {i} says {'ab' * i}" for i in range(8)]
    solo = []
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60)
        solo.append(r.json()["choices"][0]["text"])
    before = scrape(url)

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, dict[str, int]]:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        # Usage comes once, in its own last chunk, because include_usage asked for it.
        assert [e for e in events[:-2] if "usage" in e] == []
        return text, events[-2]["usage"]

    async def all_at_once() -> list[tuple[str, dict[str, int]]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(all_at_once())
    after = scrape(url)
    # Greedy output does not depend on batching: each stream equals its solo run.
    assert [t for t, _ in results] == solo
    n = len(prompts)
    for phase in PHASES:
        assert after[f"refstack:{phase}_count"] - before[f"refstack:{phase}_count"] == n, phase
        assert after[f"refstack:{phase}_sum"] > before[f"refstack:{phase}_sum"], phase
    assert after["refstack:request_success_total"] - before["refstack:request_success_total"] == n
    assert after["refstack:generation_tokens_total"] - before["refstack:generation_tokens_total"] == 6 * n
    prompt_tokens = sum(u["prompt_tokens"] for _, u in results)
    assert after["refstack:prompt_tokens_total"] - before["refstack:prompt_tokens_total"] == prompt_tokens
    assert after["refstack:num_requests_running"] == 0 and after["refstack:num_requests_waiting"] == 0
    assert after["refstack:num_slots_used"] == 0


TOO_LONG = "x" * 600  # the tiny preset's context is 512 tokens


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
])
def test_bad_requests_get_an_openai_error_body(refstack_server: Any, path: str, body: Any,
                                               param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(refstack_server.url + path, headers={"content-type": "application/json"}, timeout=30, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    # ... and the server is still up and serving.
    assert httpx.get(refstack_server.url + "/health").status_code == 200

