"""Client disconnects abort their requests and free slots; a full queue answers 503.

One slow server for the module: ``--step-delay-ms`` (the calibration knob) stretches
each engine step so the tests can act while requests are still running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

SLOW_ARGS = ["--max-running", "1", "--max-waiting", "1", "--step-delay-ms", "25"]
LONG = {"prompt": "tell me a long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def slow_server(refstack_module_server_factory: Any) -> Any:
    return refstack_module_server_factory(SLOW_ARGS)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts_and_frees_the_slot(slow_server: Any, scrape: Any) -> None:
    url = slow_server.url
    before = scrape(url)
    with httpx.stream("POST", url + "/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)  # the blank line ending each event
        assert scrape(url)["refstack:num_slots_used"] == 1  # still streaming: its slot is held
        lines.close()  # closes the connection mid-stream (httpx drops an unfinished response)
    wait_for(lambda: scrape(url)["refstack:num_slots_used"] == 0)
    after = scrape(url)
    assert after["refstack:request_aborted_total"] - before["refstack:request_aborted_total"] == 1
    assert after["refstack:num_requests_running"] == 0
    assert after["refstack:request_success_total"] == before["refstack:request_success_total"]
    # It stopped generating long before its 400 tokens.
    assert after["refstack:generation_tokens_total"] - before["refstack:generation_tokens_total"] < 200
    assert httpx.get(url + "/health").status_code == 200


def test_non_streaming_client_that_gives_up_aborts_too(slow_server: Any, scrape: Any) -> None:
    url = slow_server.url
    before = scrape(url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json={**LONG, "stream": False}, timeout=httpx.Timeout(60, read=1.0))
    wait_for(lambda: scrape(url)["refstack:num_slots_used"] == 0)
    after = scrape(url)
    assert after["refstack:request_aborted_total"] - before["refstack:request_aborted_total"] == 1
    assert after["refstack:generation_tokens_total"] - before["refstack:generation_tokens_total"] < 200


def test_full_queue_answers_503_with_retry_after(slow_server: Any, scrape: Any) -> None:
    url = slow_server.url

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:

            async def hold(started: asyncio.Event) -> None:
                async with client.stream("POST", url + "/v1/completions", json=LONG) as r:
                    started.set()
                    async for _ in r.aiter_lines():
                        pass

            first, second = asyncio.Event(), asyncio.Event()
            running = asyncio.create_task(hold(first))
            await asyncio.wait_for(first.wait(), 30)  # headers come back once it is queued
            await asyncio.to_thread(wait_for, lambda: scrape(url)["refstack:num_requests_running"] == 1)
            waiting = asyncio.create_task(hold(second))
            await asyncio.to_thread(wait_for, lambda: scrape(url)["refstack:num_requests_waiting"] == 1)
            refused = await client.post(url + "/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            running.cancel()
            waiting.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 503
    assert int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full"
    # The two held requests were dropped by their client: both slots come back, nothing waits.
    wait_for(lambda: scrape(url)["refstack:num_slots_used"] == 0 and scrape(url)["refstack:num_requests_waiting"] == 0)
    ok = httpx.post(url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
