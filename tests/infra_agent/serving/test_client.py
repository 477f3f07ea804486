"""The streaming client against a real loopback server (fake_openai_server.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from infra_agent.errors import TargetError
from infra_agent.serving.client import (
    RequestInput,
    RequestOptions,
    make_http_client,
    send_request,
)
from infra_agent.serving.runner import run_benchmark
from infra_agent.workspace.models import Scenario


def _one(url: str, endpoint: str, out: int = 8) -> object:
    async def go():  # type: ignore[no-untyped-def]
        async with make_http_client(2) as c:
            return await send_request(c, url, RequestInput("abcd", 4, out), RequestOptions(endpoint=endpoint))  # type: ignore[arg-type]

    return asyncio.run(go())


def _scenario(**kw: object) -> Scenario:
    return Scenario.model_validate({"dataset": {"kind": "random", "input_len": 16, "output_len": 6}, "num_requests": 12, **kw})


def test_completions_stream_timings(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--token-delay-ms", "10")
    rec = _one(srv.url, "completions", out=8)
    assert rec.success, rec.error
    assert rec.output_len == 8  # from the usage chunk
    assert len(rec.itl) == 7
    assert rec.ttft >= 0.010  # one token delay before the first content chunk
    # The server sleeps 10 ms before each of the 8 tokens, so the last one cannot
    # arrive before 80 ms.  Single gaps carry no such guarantee: on a busy machine
    # two chunks can reach the client in one read, so the ITLs are only checked to
    # account for the whole stream.
    assert rec.ttft + sum(rec.itl) >= 0.080 - 1e-6
    assert all(g >= 0.0 for g in rec.itl)
    assert rec.latency >= rec.ttft + sum(rec.itl) - 1e-6


def test_chat_role_chunk_is_not_a_token(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    # The role chunk arrives at once; the first content token only after 50 ms.  Under
    # either definition TTFT waits for the token: a role announcement sent before the
    # request runs would otherwise make TTFT the HTTP round trip.
    srv = fake_server_factory("--token-delay-ms", "50")
    rec = _one(srv.url, "chat", out=3)
    assert rec.success, rec.error
    assert rec.chunks == 3 and rec.content_chunks == 3
    assert rec.ttft >= 0.045 and len(rec.itl) == 2
    assert rec.content_ttft is not None and rec.content_ttft == rec.ttft
    assert rec.output_len == 3 and len(rec.content_itl) == 2
    assert rec.content_latency is not None and rec.content_latency >= rec.latency


def test_output_tokens_from_chunks_without_usage(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--token-delay-ms", "1", "--no-usage")
    rec = _one(srv.url, "completions", out=5)
    assert rec.success and rec.output_len == 5


def test_run_benchmark_concurrency_and_server_metrics(fake_server) -> None:  # type: ignore[no-untyped-def]
    res = run_benchmark(fake_server.url, _scenario(max_concurrency=3, warmup_requests=2), metrics_url=fake_server.metrics_url, progress=False)
    assert res["ok"] and res["completed"] == 12 and res["failed"] == 0
    assert res["total_output_tokens"] == 72
    assert res["model_id"] == "fake-model"
    # The fake server observes e2e once per request: warmup requests fall outside the window.
    assert res["server_metrics"]["e2e"]["count"] == 12
    assert res["server_metrics"]["queue"]["mean_s"] == pytest.approx(0.001)
    assert len(res["ttfts"]) == len(res["itls"]) == len(res["errors"]) == 12


def _requested_tokens(metrics_url: str) -> float:
    import httpx

    text = httpx.get(metrics_url, trust_env=False).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("fake_requested_tokens_total")))


def test_reachability_check_is_short_without_warmup(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    # warmup_requests 0: the one check request asks for 2 tokens, not a full output,
    # so short repeated runs (a judge's) are not padded by a full-length request each.
    srv = fake_server_factory("--token-delay-ms", "1")
    run_benchmark(srv.url, _scenario(max_concurrency=4), metrics_url=srv.metrics_url, progress=False)
    assert _requested_tokens(srv.metrics_url) == 12 * 6 + 2
    # Asked-for warm-up requests stay full length.
    run_benchmark(srv.url, _scenario(max_concurrency=4, warmup_requests=2), metrics_url=srv.metrics_url, progress=False)
    assert _requested_tokens(srv.metrics_url) == (12 * 6 + 2) + (12 * 6 + 2 * 6)


def test_rate_based_run(fake_server) -> None:  # type: ignore[no-untyped-def]
    res = run_benchmark(fake_server.url, _scenario(request_rate=40.0, burstiness=1.0), progress=False)
    assert res["completed"] == 12
    assert res["request_rate"] == 40.0


def test_unreachable_url_is_a_target_error() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(TargetError, match="cannot reach"):
        run_benchmark(f"http://127.0.0.1:{port}", _scenario(), progress=False)


def test_non_streaming_server_is_a_target_error(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--mode", "json")
    with pytest.raises(TargetError, match="OpenAI-compatible streaming"):
        run_benchmark(srv.url, _scenario(), progress=False)
    rec = _one(srv.url, "completions")
    assert not rec.success and rec.error_kind == "protocol" and "event stream" in rec.error


def test_stream_without_token_chunks_is_a_failed_request_not_a_target_error(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    # A well-formed stream with a usage chunk but no chunk carrying choices: nothing to
    # time a TTFT by, so vLLM's client fails the request and so do we; the server is
    # reachable and speaks the protocol, so the run goes on.
    srv = fake_server_factory("--mode", "empty")
    res = run_benchmark(srv.url, _scenario(), progress=False)
    assert res["completed"] == 0 and res["failed"] == 12
    assert all("without a single token chunk" in e and "usage reported 6 completion tokens" in e for e in res["errors"])
