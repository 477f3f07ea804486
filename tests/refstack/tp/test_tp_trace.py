"""The TP spans: every rank's forward, all-reduce and gather are spans carrying the rank,
and GET /debug/trace merges the other ranks' spans into rank 0's."""

from __future__ import annotations

from collections import Counter
from types import ModuleType
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_the_trace_shows_each_ranks_communication_against_its_compute(refstack_server_factory: Any,
                                                                       agreement: ModuleType) -> None:
    server = refstack_server_factory([*agreement.FLAGS, "--tp", "2", "--trace", "true", "--trace-level", "layer"])
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    events = httpx.get(server.url + "/debug/trace", timeout=30).json()["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    by_rank = Counter((e["name"], e["args"].get("rank")) for e in spans if "rank" in e.get("args", {}))
    steps = by_rank[("tp.forward", 0)]
    assert steps >= 4 and by_rank[("tp.forward", 1)] == steps  # rank 1 mirrors every step of rank 0
    layers = 4  # tiny: 2 KDA + 2 attention layers, each an o_proj all-reduce and an MoE all-reduce
    for rank in (0, 1):
        assert by_rank[("tp.all_reduce", rank)] == 2 * layers * steps
        assert by_rank[("tp.gather", rank)] == steps
        assert by_rank[("lm_head", rank)] == steps
    what = {e["args"]["what"] for e in spans if e["name"] == "tp.all_reduce"}
    assert what == {"kda0.o_proj", "attn1.o_proj", "kda2.o_proj", "attn3.o_proj", "moe0", "moe1", "moe2", "moe3"}
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any(n.startswith("refstack tp rank 1 (pid ") for n in names), names
    pids = {e["pid"] for e in spans if e["name"] == "tp.forward"}
    assert len(pids) == 2  # the ranks' spans stay on their own process tracks
