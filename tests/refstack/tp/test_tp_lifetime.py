"""The ranks' lifetime: refstack starts and stops them; one dying takes the server down
cleanly, fails the requests in flight with an error (never a hang), and leaves no orphans."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import ModuleType
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (its parent may not have reaped it yet)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def test_a_dying_rank_fails_the_requests_in_flight_and_stops_the_server(refstack_server_factory: Any,
                                                                        agreement: ModuleType) -> None:
    server = refstack_server_factory([*agreement.FLAGS, "--tp", "2"])
    info = httpx.get(server.url + "/debug/engine", timeout=10).json()["tp"]
    assert info["world"] == 2 and info["backend"] == "gloo" and len(info["pids"]) == 2
    rank1 = info["pids"][1]
    answers: list[Any] = []

    def ask() -> None:  # a long generation, in flight when the rank dies
        try:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 400,
                                                                 "ignore_eos": True}, timeout=60)
            answers.append((r.status_code, r.json()))
        except httpx.HTTPError as exc:
            answers.append(exc)

    events: list[str] = []

    def stream() -> None:  # the same, streamed: the failure arrives as an event
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                              json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))
        except httpx.HTTPError as exc:
            events.append(repr(exc))

    threads = [threading.Thread(target=ask), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(rank1, signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a request hung after its rank died"
    # The stream ends with the error event, then [DONE], as any failed stream does.
    assert events[-1] == "data: [DONE]" and "tensor-parallel rank 1 died" in events[-2], events[-3:]
    assert answers and isinstance(answers[0], tuple), answers
    status, body = answers[0]
    assert status == 500 and "tensor-parallel rank 1 died" in body["error"]["message"], body
    assert server.proc.wait(30) == 1
    assert "refstack: error: tensor-parallel rank 1 died (exit code -9); shutting down" in server.log()
    assert _gone(info["pids"])


def test_sigterm_stops_every_rank(refstack_server_factory: Any, agreement: ModuleType) -> None:
    server = refstack_server_factory([*agreement.FLAGS, "--tp", "2"])
    pids = httpx.get(server.url + "/debug/engine", timeout=10).json()["tp"]["pids"]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert _gone(pids)


def test_a_killed_server_leaves_no_rank_behind(refstack_server_factory: Any, agreement: ModuleType) -> None:
    server = refstack_server_factory([*agreement.FLAGS, "--tp", "2"])
    pids = httpx.get(server.url + "/debug/engine", timeout=10).json()["tp"]["pids"]
    os.kill(server.proc.pid, signal.SIGKILL)  # no handler runs: the kernel's parent-death signal must
    server.proc.wait(10)
    assert _gone(pids[1:])
