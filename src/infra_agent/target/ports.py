"""Free loopback ports, so no target ever needs a hard-coded one."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port the OS reports free on ``host`` right now.

    Another process may take it before the server binds it; ``ServerProcess``
    retries with a fresh port when the server's log says the address was in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
