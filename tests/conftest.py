"""Shared pytest setup: GPU tests skip cleanly on machines without CUDA."""

from __future__ import annotations

import os as _os

import pytest

# Rich sizes its output to COLUMNS when it is set (some hosts export COLUMNS=80): pin a
# wide one, before any console is created, so tables and messages that tests read are
# laid out the same on every machine.
_os.environ["COLUMNS"] = "200"

# Under pytest-xdist every worker, and every server it starts, would size its torch/OpenMP
# pool to the whole host: on a 16-core GPU host, 15 workers x 16 threads thrash the
# cores and the suite runs slower than serially. Give each worker its share of the cores
# (inherited by the servers it spawns) unless the caller chose a size already.
_workers = int(_os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)

# The suite runs servers side by side on purpose (several xdist workers on a few cores), so
# every serving window shares the machine with other tests' servers: re-running windows
# taken under foreign load (agent/executors/worker.py) would only multiply the suite's time.
# The tests of that rule pass their threshold explicitly.
_os.environ.setdefault("INFRA_AGENT_MAX_FOREIGN_CPU", "off")
if _workers > 1 and "OMP_NUM_THREADS" not in _os.environ:
    _os.environ["OMP_NUM_THREADS"] = str(max(1, (_os.cpu_count() or 1) // _workers))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none found); GPU results live in docs/performance.md")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# ---- refstack server fixtures ---------------------------------------------------------
# `refstack_server` (session-wide, default knobs) and `refstack_server_factory` (extra
# flags / env per test) start the real `refstack serve` in a subprocess of its own
# process group on a free loopback port, and stop the whole group at teardown.

import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator, Mapping, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

_URL_LINE = re.compile(r"refstack serving on (http://\S+)")
# Generous: the box is a shared, busy 2-core machine and the server imports torch; a
# disaggregated server starts up to five processes that each import it (EPD: 60-90 s seen
# at load 16-32). A server that dies is noticed at once, so the limit costs nothing then.
_START_TIMEOUT_S = 240.0


@dataclass
class RefstackServer:
    """A running `refstack serve`; ``url`` has no trailing slash."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM to the group (a graceful exit: atexit hooks such as the trace dump run),
        SIGKILL if it lingers; returns the exit status."""
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc, signal.SIGKILL)
                self.proc.wait(10)
        # Children that outlived the leader (none expected) go too.
        _signal_group(self.proc, signal.SIGKILL)
        return self.proc.returncode


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session=True made pid the group id
    except (ProcessLookupError, PermissionError):
        pass


def start_refstack_server(log_dir: Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                          preset: str = "tiny") -> RefstackServer:
    """Start `python -m refstack.cli serve --preset PRESET --port 0 ARGS` and wait until healthy."""
    import httpx

    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"refstack-serve-{time.monotonic_ns()}.log"
    full_env = {k: v for k, v in os.environ.items() if k != "INFRA_AGENT_TRACE"}
    full_env.update(env or {})
    full_env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "refstack.cli", "serve", "--preset", preset, "--host", "127.0.0.1",
           "--port", "0", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = RefstackServer("", proc, log_path, tuple(args), dict(env or {}))
    deadline = time.monotonic() + _START_TIMEOUT_S
    try:
        while not server.url:
            match = _URL_LINE.search(server.log())
            if match:
                server.url = match.group(1).rstrip("/")
            elif proc.poll() is not None:
                raise RuntimeError(f"refstack serve exited with {proc.returncode}:\n{server.log()[-3000:]}")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"refstack serve printed no URL in {_START_TIMEOUT_S}s:\n{server.log()[-3000:]}")
            else:
                time.sleep(0.05)
        while True:
            try:
                if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"refstack serve never became healthy:\n{server.log()[-3000:]}")
            time.sleep(0.05)
    except BaseException:
        server.stop()
        raise


@pytest.fixture(scope="session")
def refstack_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RefstackServer]:
    """One tiny-preset server with default knobs for the whole session; read metrics as deltas."""
    server = start_refstack_server(tmp_path_factory.mktemp("refstack-server"))
    try:
        yield server
    finally:
        server.stop()


def _server_factory(base: Path) -> Iterator[Callable[..., RefstackServer]]:
    """Yields ``start(args=[...], env={...}, preset="tiny")``; stops every server after."""
    started: list[RefstackServer] = []

    def start(args: Sequence[str] = (), env: Mapping[str, str] | None = None, preset: str = "tiny") -> RefstackServer:
        server = start_refstack_server(base / f"server{len(started)}", args, env, preset)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def refstack_server_factory(tmp_path: Path) -> Iterator[Callable[..., RefstackServer]]:
    """Servers started with extra flags or env, stopped after the test."""
    yield from _server_factory(tmp_path)


@pytest.fixture(scope="module")
def refstack_module_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RefstackServer]]:
    """Like ``refstack_server_factory``, but the servers live for the whole test module."""
    yield from _server_factory(tmp_path_factory.mktemp("refstack-module-servers"))
