"""Small things a new user meets: a base URL ending in /v1, the default warm-up, Ctrl-C at start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.errors import TargetError
from infra_agent.serving.runner import run_benchmark
from infra_agent.workspace.models import Scenario

runner = CliRunner()


def _requested(url: str) -> float:
    for line in httpx.get(url + "/metrics", trust_env=False).text.splitlines():
        if line.startswith("fake_requested_tokens_total"):
            return float(line.split()[-1])
    return 0.0


def test_base_url_with_v1_is_fixed_up_and_said(fake_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", fake_server.url + "/v1/", "--num-requests", "2", "--output-len", "3",
                              "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert f"using the base URL {fake_server.url} (requests go to {fake_server.url}/v1/...)" in res.output
    data = json.loads(out.read_text())
    assert data["url"] == fake_server.url and data["completed"] == 2


def test_a_404_names_the_v1_mistake(fake_server) -> None:  # type: ignore[no-untyped-def]
    sc = Scenario.model_validate({"dataset": {"kind": "random", "input_len": 4, "output_len": 2}, "num_requests": 1})
    with pytest.raises(TargetError, match=r"HTTP 404 .*without /v1 .*HTTP 404 from .*/v1/v1/completions"):
        run_benchmark(fake_server.url + "/v1", sc, progress=False)


def test_url_mode_default_warmup_is_one_short_check(fake_server_factory) -> None:  # type: ignore[no-untyped-def]
    # As documented: without --warmup-requests, only the 2-token check goes before the window.
    srv = fake_server_factory()
    res = runner.invoke(app, ["bench", srv.url, "--num-requests", "3", "--output-len", "8", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert _requested(srv.url) == 3 * 8 + 2
    res = runner.invoke(app, ["bench", srv.url, "--num-requests", "3", "--output-len", "8", "--warmup-requests", "2",
                              "--no-progress"])
    assert res.exit_code == 0, res.output
    assert _requested(srv.url) == (3 * 8 + 2) + (2 * 8 + 3 * 8)


SLOW_START = """\
name: slow
target:
  kind: server
  command: ["{python}", "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)", "{marker}", "{{port}}"]
  ready_url: /health
  ready_timeout_s: 120
  stop_grace_s: 5
scenarios:
  s:
    dataset: {{kind: random, input_len: 4, output_len: 2}}
    num_requests: 1
"""

DRIVER = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from infra_agent.cli.main import app
app(["bench", sys.argv[1], "--no-progress"])
"""


def test_ctrl_c_while_the_server_starts_says_so(tmp_path: Path) -> None:
    marker = tmp_path / "server.pid"
    (tmp_path / "infra-agent.yaml").write_text(SLOW_START.format(python=sys.executable, marker=marker))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the server never started"
        server_pid = int(marker.read_text())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "bench: interrupted while the target of slow was starting; it has been stopped" in err
    # ... and it has: the launched process is gone.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"server {server_pid} still runs")


def test_endpoint_target_url_drops_v1() -> None:
    from infra_agent.target.endpoint import EndpointTarget
    from infra_agent.workspace.models import EndpointTargetSpec

    for given in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/"):
        target = EndpointTarget(EndpointTargetSpec.model_validate({"kind": "endpoint", "url": given, "metrics_url": "/metrics"}))
        assert target.url == "http://127.0.0.1:8000" and target.metrics_url == "http://127.0.0.1:8000/metrics"
