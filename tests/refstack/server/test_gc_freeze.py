"""``--gc-freeze``: a served engine's startup heap is out of the collector's reach, and /debug/engine says so."""

from __future__ import annotations

import httpx


def test_the_server_freezes_its_heap_by_default_and_not_when_told(refstack_server_factory) -> None:  # type: ignore[no-untyped-def]
    frozen = {}
    for flag in ("true", "false"):
        server = refstack_server_factory(args=["--gc-freeze", flag])
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert reply.status_code == 200
        info = httpx.get(server.url + "/debug/engine", timeout=10).json()
        assert info["config"]["gc_freeze"] is (flag == "true")
        frozen[flag] = info["gc"]["frozen_by_refstack"]
        # The process-wide count (frozen_objects) includes what a library froze on its own
        # (375 objects on a CUDA host, none here): refstack's share is reported apart.
        assert len(info["gc"]["counts"]) == len(info["gc"]["thresholds"]) == 3
    # The model's modules and tensors, torch's and the web stack's imports: tens of thousands of objects.
    assert frozen["true"] > 10_000 and frozen["false"] == 0, frozen
