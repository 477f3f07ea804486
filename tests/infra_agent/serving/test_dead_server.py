"""A real refstack server killed mid-benchmark stops the window; a client out of file
descriptors against a live one does not (serving/dead_server.py).

Both run ``infra-agent bench`` as a subprocess against a real ``refstack serve``.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

STOPPED = "stopped before an answer: the server stopped accepting connections"


def _bench(url: str, out: Path, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "infra_agent.cli.main", "bench", url, "--input-len", "8",
                             "--output-len", "4", "--no-progress", "-o", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_a_refstack_server_killed_mid_benchmark_stops_the_window(refstack_server_factory: Any, tmp_path: Path) -> None:
    server = refstack_server_factory()
    out, log = tmp_path / "r.json", tmp_path / "r.requests.jsonl"
    bench = _bench(server.url, out, "--num-requests", "20000", "--max-concurrency", "4")
    try:
        deadline = time.monotonic() + 180
        while not (log.exists() and len(log.read_text().splitlines()) >= 40):
            assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
            time.sleep(0.1)
        os.killpg(server.proc.pid, signal.SIGKILL)  # the whole server, mid-window
        _, err = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 1, err[-3000:]
    data = json.loads(out.read_text())
    lines = _lines(log)
    assert sorted(x["index"] for x in lines) == list(range(20000))
    # It stopped at the first refusals in a row: a handful of requests met the dead server,
    # not the ~20 000 that were left to send.
    refused = [x for x in lines if x["error_kind"] == "connect"]
    assert 16 <= len(refused) < 100, len(refused)
    unsent = [x for x in lines if (x["error"] or "").startswith(STOPPED)]
    ended = len(lines) - len(unsent)
    assert data["completed"] >= 30 and len(unsent) > 19_000
    # The message counts what had ended when it stopped, not every record written after.
    assert data["stopped"].startswith("the server stopped accepting connections (16 refusals in a row")
    assert data["stopped"].endswith(f"the window stopped sending after {ended} of 20000 requests"), data["stopped"]
    assert data["ok"] is False and "the server stopped accepting connections" in data["error"]


@pytest.mark.slow
def test_a_client_out_of_file_descriptors_does_not_stop_a_live_server_window(refstack_server_factory: Any,
                                                                             tmp_path: Path) -> None:
    # 400 requests at once from a client allowed 100 open files: most cannot even open a
    # socket (EMFILE).  The server never saw them; counted as refusals, they stopped the
    # window and blamed a server that was answering the rest.
    server = refstack_server_factory()
    out = tmp_path / "r.json"

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))

    bench = _bench(server.url, out, "--num-requests", "400", preexec_fn=few_files)
    _, err = bench.communicate(timeout=300)
    assert bench.returncode == 1, err[-3000:]  # the failed requests still fail the run
    data = json.loads(out.read_text())
    assert "stopped" not in data, data["stopped"]
    client_side = [x for x in _lines(tmp_path / "r.requests.jsonl") if x["error_kind"] == "client"]
    assert len(client_side) > 100 and all("this client could not open a connection" in x["error"] and
                                          "ulimit -n" in x["error"] for x in client_side)
    assert data["completed"] > 0 and data["completed"] + len(client_side) == 400
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
