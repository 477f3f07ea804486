"""``POST /start_profile`` and ``/stop_profile``: torch.profiler on a running server's
engine thread, over HTTP against a real refstack server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from infra_agent.trace.load import load_timeline


def _complete(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "profile me", "max_tokens": 6, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200


def test_profile_of_a_window_records_the_engine_threads_ops(refstack_server_factory: Any, tmp_path: Path) -> None:
    server = refstack_server_factory()
    url = server.url
    stop = httpx.post(url + "/stop_profile")
    assert stop.status_code == 409 and stop.json()["error"]["code"] == "profiling_inactive"
    started = httpx.post(url + "/start_profile", params={"output_dir": str(tmp_path)}, timeout=60)
    assert started.status_code == 200 and started.json() == {"profiling": True, "output_dir": str(tmp_path)}
    again = httpx.post(url + "/start_profile")
    assert again.status_code == 409 and again.json()["error"]["code"] == "profiling_active"
    _complete(url)
    done = httpx.post(url + "/stop_profile", timeout=120).json()
    path = Path(done["trace"])
    assert done["profiling"] is False and path.parent == tmp_path and done["events"] > 0
    # The step's ops, all on one thread that is not the server's main thread (whose native
    # id is the pid): the engine's loop thread, where the profiler was started.
    events = json.loads(path.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    assert len(ops) > 50, len(ops)
    threads = {e["tid"] for e in ops}
    assert len(threads) == 1 and threads != {ops[0]["pid"]}, threads
    tl = load_timeline([], kineto=[path])
    assert tl.sources[0]["format"] == "kineto" and any(s.cat == "cpu_op" for s in tl.spans)
    # Off again: a second window is a fresh profile; export=false drops it.
    assert httpx.post(url + "/start_profile", timeout=60).status_code == 200
    _complete(url)
    assert httpx.post(url + "/stop_profile", params={"export": "false"}, timeout=60).json() == {"profiling": False,
                                                                                               "trace": None}
    _complete(url)  # the server still serves
