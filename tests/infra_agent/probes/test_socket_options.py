"""TCP_NODELAY read from a real server process's client connections (probes/socket_options.py).

The server is a plain socket server in a subprocess that sets, or leaves unset,
``TCP_NODELAY`` on each connection it accepts; the reading comes from its sockets, not
from anything it says.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import pytest

from infra_agent.probes.socket_options import tcp_nodelay

SERVER = """
import socket, sys
nodelay = sys.argv[1] == "on"
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
print(listener.getsockname()[1], flush=True)
held = []
while True:
    conn, _ = listener.accept()
    if nodelay:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    held.append(conn)
"""


def _read(option: str, clients: int = 3) -> tuple[dict[str, int] | None, int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, option], stdout=subprocess.PIPE, text=True)
    conns: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(clients)]
        deadline = time.monotonic() + 30
        got = tcp_nodelay(proc.pid, port)
        while (got is None or got["connections"] < clients) and time.monotonic() < deadline:
            time.sleep(0.1)  # the server accepts them one by one
            got = tcp_nodelay(proc.pid, port)
        return got, port
    finally:
        for c in conns:
            c.close()
        proc.kill()
        proc.wait(10)


def _readable() -> bool:
    got, _ = _read("on", clients=1)
    return got is not None


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and pidfd_getfd")
def test_nodelay_is_read_from_the_servers_own_sockets() -> None:
    if not _readable():
        pytest.skip("pidfd_getfd refused here (no ptrace permission on the server process)")
    on, _ = _read("on")
    off, _ = _read("off")
    assert on == {"connections": 3, "nodelay": 3}
    assert off == {"connections": 3, "nodelay": 0}


def test_no_connection_on_the_port_is_unknown() -> None:
    import os

    assert tcp_nodelay(os.getpid(), 1) is None


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and pidfd_getfd")
def test_refstacks_connections_have_nagle_off(refstack_server_factory: Any) -> None:
    """refstack binds its listener with IPPROTO_TCP, so asyncio sets TCP_NODELAY on every
    accepted connection: read from the server's own sockets, while keep-alive connections are open."""
    import httpx

    if not _readable():
        pytest.skip("pidfd_getfd refused here (no ptrace permission on the server process)")
    server = refstack_server_factory()
    port = urlsplit(server.url).port
    assert port is not None
    clients = [httpx.Client(base_url=server.url, timeout=30) for _ in range(3)]
    try:
        for c in clients:  # one request each; the connection stays open (keep-alive)
            assert c.get("/health").status_code == 200
        got = tcp_nodelay(server.proc.pid, port)
        assert got is not None and got["connections"] >= 3 and got["nodelay"] == got["connections"], got
    finally:
        for c in clients:
            c.close()
