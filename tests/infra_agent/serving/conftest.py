"""Fixtures: a real loopback streaming server in a subprocess (see fake_openai_server.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

_SERVER = Path(__file__).with_name("fake_openai_server.py")


class FakeServer:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url
        self.metrics_url = url + "/metrics"


def _start(*args: str) -> FakeServer:
    proc = subprocess.Popen([sys.executable, str(_SERVER), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), f"fake server did not start: {line!r}"
    url = line.split()[1]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            # Any answer but a server error: with --api-key-env, /v1/models says 401.
            if httpx.get(url + "/v1/models", timeout=1.0, trust_env=False).status_code < 500:
                return FakeServer(proc, url)
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("fake server never answered")


@pytest.fixture
def fake_server_factory() -> Iterator[Callable[..., FakeServer]]:
    started: list[FakeServer] = []

    def factory(*args: str) -> FakeServer:
        srv = _start(*args)
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        if srv.proc.poll() is None:
            srv.proc.terminate()
            try:
                srv.proc.wait(5)
            except subprocess.TimeoutExpired:
                srv.proc.kill()


@pytest.fixture
def fake_server(fake_server_factory: Callable[..., FakeServer]) -> FakeServer:
    return fake_server_factory()


@pytest.fixture
def fake_workspace(tmp_path: Path) -> Callable[..., Path]:
    """A workspace whose server target is the fake server, launched by the target lifecycle."""

    def make(extra_args: str = "", num_requests: int = 10) -> Path:
        ws = tmp_path / "ws"
        ws.mkdir(exist_ok=True)
        argv = [sys.executable, str(_SERVER), "--port", "{port}", "--token-delay-ms", "{token_delay_ms}", *extra_args.split()]
        import json

        (ws / "infra-agent.yaml").write_text(
            "target:\n"
            "  kind: server\n"
            f"  command: {json.dumps(argv)}\n"
            "  ready_url: /v1/models\n"
            "  metrics_url: /metrics\n"
            "  ready_timeout_s: 30\n"
            "knobs:\n"
            "  token_delay_ms: {type: float, min: 0, max: 100, default: 2}\n"
            "scenarios:\n"
            "  small:\n"
            "    dataset: {kind: random, input_len: 16, output_len: 6}\n"
            f"    num_requests: {num_requests}\n"
            "    max_concurrency: 4\n"
        )
        return ws

    return make
