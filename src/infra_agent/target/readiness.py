"""When a launched server is ready: its ``ready_url`` answers 200 while its process lives.

Apart from ``ServerProcess`` because it is a question asked over HTTP, with its own
pitfalls: a proxy from the environment must not answer for a loopback server, and a
``ready_url`` another process already serves would say "ready" for a server that has
not bound its port yet.  The answers are values; ``ServerProcess`` words the errors.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

_POLL_S = 0.1
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def taken_ready_port(ready_url: str, port: int) -> int | None:
    """The loopback port of ``ready_url`` when someone already serves it, else None.

    Only a ``ready_url`` on another port than the server's own is asked: readiness would
    then be read from the other process, and the server would die on its bind in the
    middle of the run.
    """
    parts = urlsplit(ready_url)
    if parts.hostname not in _LOOPBACK_NAMES or parts.port in (None, port):
        return None
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1.0):
            pass
    except OSError:
        return None  # nothing listens: free
    return parts.port


@dataclass(frozen=True)
class NotReady:
    """Why a server never became ready: it exited (``exit_code``), or time ran out (``last`` answer)."""

    exit_code: int | None
    last: str


def wait_ready(proc: subprocess.Popen[bytes], ready_url: str, headers: Mapping[str, str],
               timeout_s: float) -> NotReady | None:
    """Poll ``ready_url`` until it answers 200 (None), the process exits, or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    # trust_env=False: a proxy from the environment must not intercept loopback.
    with httpx.Client(trust_env=False, timeout=2.0, headers=dict(headers)) as client:
        while True:
            code = proc.poll()
            if code is not None:
                return NotReady(code, last)
            try:
                resp = client.get(ready_url)
                if resp.status_code == 200:
                    return None
                last = f"HTTP {resp.status_code}"
            except httpx.TransportError as exc:
                last = type(exc).__name__
            if time.monotonic() >= deadline:
                return NotReady(None, last)
            time.sleep(_POLL_S)
