"""vLLM's latency definitions on recorded vLLM streams, replayed by a real loopback server.

The fixtures are streams a vLLM 0.32 CPU server sent (tests/infra_agent/serving/fixtures,
recorded with their gaps): a tiny random Llama whose greedy picks are mostly special
tokens, which vLLM streams as chunks with empty text.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.serving.client import (
    RequestInput,
    RequestOptions,
    make_http_client,
    send_request,
)
from infra_agent.serving.runner import run_benchmark
from infra_agent.workspace.models import Scenario

FIXTURES = Path(__file__).with_name("fixtures")
SPECIAL_ONLY = FIXTURES / "vllm-0.32-cpu-completions-stream-special-only.jsonl"
MIXED = FIXTURES / "vllm-0.32-cpu-completions-stream.jsonl"
MIXED_CHAT = FIXTURES / "vllm-0.32-cpu-chat-stream.jsonl"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _choice_texts(path: Path) -> list[str]:
    out = []
    for e in _events(path):
        data = e["data"]
        if isinstance(data, dict) and data.get("choices"):
            c = data["choices"][0]
            out.append(c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or "")
    return out


def _one(url: str, endpoint: str = "completions"):  # type: ignore[no-untyped-def]
    async def go():  # type: ignore[no-untyped-def]
        async with make_http_client(2) as c:
            return await send_request(c, url, RequestInput("abcd", 4, 16), RequestOptions(endpoint=endpoint))  # type: ignore[arg-type]

    return asyncio.run(go())


def _scenario(n: int = 6, **kw: object) -> Scenario:
    return Scenario.model_validate({"dataset": {"kind": "random", "input_len": 8, "output_len": 16}, "num_requests": n,
                                    "max_concurrency": 3, **kw})


@pytest.mark.parametrize(("fixture", "endpoint"), [(MIXED, "completions"), (MIXED_CHAT, "chat")])
def test_recorded_stream_with_empty_chunks_is_timed_as_vllm_times_it(fake_server_factory, fixture: Path, endpoint: str) -> None:  # type: ignore[no-untyped-def]
    texts = _choice_texts(fixture)
    empty = sum(1 for t in texts if not t)
    assert 0 < empty < len(texts), "the fixture must mix empty and non-empty chunks"
    usage = next(e["data"]["usage"] for e in _events(fixture) if isinstance(e["data"], dict) and e["data"].get("usage"))
    srv = fake_server_factory("--replay", str(fixture))
    rec = _one(srv.url, endpoint)
    assert rec.success, rec.error
    # vLLM: every chunk with choices is a token event, empty or not; the chat role
    # announcement is not (vLLM's server sends it 0.1 ms before the first token's chunk).
    role = 1 if endpoint == "chat" else 0
    assert rec.chunks == len(texts) - role and len(rec.itl) == len(texts) - 1 - role
    assert rec.output_len == usage["completion_tokens"]
    # The latency ends at the last token chunk: TTFT plus the gaps, exactly.
    assert rec.ttft + sum(rec.itl) == pytest.approx(rec.latency, abs=1e-9)
    # Content-based: only chunks with text, so fewer gaps and a later (or equal) first token.
    assert rec.content_chunks == len(texts) - empty and len(rec.content_itl) == rec.content_chunks - 1
    if role:
        # Against vLLM's own client the role chunk only moves TTFT by its recorded gap.
        gap = next(e["dt_ms"] for e in _events(fixture)[1:2]) / 1e3
        assert gap < 0.001
    assert rec.content_ttft is not None and rec.content_ttft >= rec.ttft
    first_text = next(i for i, t in enumerate(texts) if t)
    if first_text > 0:
        assert rec.content_ttft > rec.ttft
    # The replay keeps the recorded gaps, so each measured gap is at least the recorded one.
    recorded = [e["dt_ms"] / 1e3 for e in _events(fixture) if isinstance(e["data"], dict) and e["data"].get("choices")]
    assert rec.ttft >= recorded[0] - 1e-3


def test_result_reports_both_definitions_labelled(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--replay", str(MIXED))
    res = run_benchmark(srv.url, _scenario(), progress=False)
    assert res["completed"] == 6 and res["failed"] == 0 and res["latency_definition"] == "vllm"
    texts = _choice_texts(MIXED)
    assert all(len(gaps) == len(texts) - 1 for gaps in res["itls"])
    alt = res["content_latency"]
    assert alt["timed"] == 6 and alt["median_ttft_ms"] >= res["median_ttft_ms"]
    as_content = run_benchmark(srv.url, _scenario(), progress=False, latency_definition="content")
    assert as_content["latency_definition"] == "content" and "vllm_latency" in as_content
    assert all(len(gaps) == sum(1 for t in texts if t) - 1 for gaps in as_content["itls"])
    # The judge refuses to compare numbers measured under different definitions.
    (tmp_path / "a.json").write_text(json.dumps(res))
    (tmp_path / "b.json").write_text(json.dumps(as_content))
    cmp = runner.invoke(app, ["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert cmp.exit_code == 2 and "latency_definition: A vllm, B content" in cmp.output


def test_special_token_stream_is_a_valid_completion(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert not any(_choice_texts(SPECIAL_ONLY)), "every chunk of this recording has empty text"
    srv = fake_server_factory("--replay", str(SPECIAL_ONLY))
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", srv.url, "--num-requests", "4", "--input-len", "8", "--output-len", "16",
                              "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["failed"] == 0 and data["ok"] is True
    assert data["output_lens"] == [16] * 4  # from usage, not from the (empty) text
    assert data["median_ttft_ms"] > 0 and data["median_tpot_ms"] > 0
    assert data["content_latency"]["timed"] == 0  # no text: nothing to time by content
    as_content = run_benchmark(srv.url, _scenario(4), progress=False, latency_definition="content")
    assert as_content["completed"] == 4 and as_content["ttfts"] == [None] * 4


runner = CliRunner()


def test_failed_requests_fail_the_run_with_exit_status_1(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Streams without a single token chunk fail (as in vLLM's client), and failures
    # fail the run (exit 1) unless --max-failed-fraction allows them.
    srv = fake_server_factory("--mode", "empty")
    res = runner.invoke(app, ["bench", srv.url, "--num-requests", "4", "--no-progress", "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["ok"] is False and data["failed"] == 4 and "4 of 4 requests failed" in data["error"]
