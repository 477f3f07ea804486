"""The client-server TTFT gap split by refstack's own marks, on a real server.

A refstack server with tracing on serves streamed chats; its trace (``GET /debug/trace``)
marks each request's hand-over to the engine, the engine seeing it, its first token and
that token's bytes written.  The split has every phase for every request, the phases
follow each other, and a ``client_server_ttft_gap`` finding gets them, the largest first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from infra_agent.feedback import Finding
from infra_agent.trace.load import load_timeline
from infra_agent.trace.ttft_split import split_ttft_gap, ttft_split
from infra_agent.vocabulary import FindingKind

REQUESTS = 4


def test_refstack_marks_split_the_ttft_of_every_streamed_request(refstack_server_factory: Any,
                                                                 tmp_path: Path) -> None:
    import httpx

    server = refstack_server_factory(args=["--trace", "true"])
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    ttfts = []
    for i in range(REQUESTS):
        body = {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8,
                "stream": True}
        t0 = time.perf_counter()
        first = None
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if first is None and '"content"' in line:
                    first = time.perf_counter() - t0
        assert first is not None
        ttfts.append(first * 1e3)
    path = tmp_path / "trace.json"
    path.write_text(httpx.get(server.url + "/debug/trace", timeout=60).text)
    split = ttft_split(load_timeline([path]).instants)
    assert split is not None and split["requests"] == REQUESTS, split
    phases = split["phases"]
    assert set(phases) == {"admission", "engine", "delivery"}, split
    assert all(p["n"] == REQUESTS and p["mean_ms"] >= 0 for p in phases.values()), split
    # The marks follow each other, so the parts add up to the server's own submit -> write.
    whole = sum(p["mean_ms"] for p in phases.values())
    assert abs(whole - split["submit_to_write_mean_ms"]) < 1e-6 * max(whole, 1.0) + 1e-6, split
    # The server's part lies inside the client's TTFT.
    assert split["submit_to_write_mean_ms"] < sum(ttfts) / len(ttfts), (split, ttfts)
    f = Finding(kind=FindingKind.CLIENT_SERVER_TTFT_GAP, severity="info", message="client TTFT vs server",
                evidence={"client_ttft_ms": sum(ttfts) / len(ttfts)})
    split_ttft_gap([f], split)
    parts = f.evidence["ttft_split"]["parts_ms"]
    assert set(parts) == {"admission", "engine", "delivery", "before the hand-over"}
    assert "admission (handed to the engine -> engine sees it)" in f.message
    assert "first-token delivery (emitted -> bytes written)" in f.message and f.next_question


def test_no_marks_no_split() -> None:
    assert ttft_split([]) is None
    f = Finding(kind=FindingKind.CLIENT_SERVER_TTFT_GAP, severity="info", message="m")
    split_ttft_gap([f], None)
    assert f.message == "m" and "ttft_split" not in f.evidence
