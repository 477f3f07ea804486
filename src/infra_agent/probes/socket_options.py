"""Whether a server's client connections have Nagle's algorithm off (``TCP_NODELAY``), read from the server.

A stream whose chunks arrive in bursts has Nagle's algorithm as one textbook cause (a
small segment held until the previous one is acknowledged, behind the client's delayed
ACK), but only on a socket without ``TCP_NODELAY``.  Whether it is set is a fact about
the server's sockets, so it is read from them rather than guessed: for a server process
on this machine, its established TCP connections on the port it serves (``/proc/PID/fd``
and ``/proc/PID/net/tcp{,6}``) are duplicated into this process with ``pidfd_getfd``
(Linux 5.6+, the same permission as ptrace, which py-spy needs anyway) and asked with
``getsockopt``.  Any server: ours, vLLM, SGLang.  When it cannot be read (another OS, no
permission, no connection open at that moment) the answer is None: unknown.
"""

from __future__ import annotations

import os
import socket
from typing import Any

_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (added in 5.6)
_ESTABLISHED = "01"


def _connections(pid: int, port: int) -> set[int]:
    """Socket inodes of the process's established TCP connections whose local port is ``port``."""
    out: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _ESTABLISHED and int(cols[1].rsplit(":", 1)[1], 16) == port:
                out.add(int(cols[9]))
    return out


def tcp_nodelay(pid: int, port: int, limit: int = 16) -> dict[str, Any] | None:
    """``{"connections": n, "nodelay": k}`` over up to ``limit`` of the server's client connections
    on ``port``; None when none could be read (unknown)."""
    import ctypes

    if not hasattr(os, "pidfd_open"):
        return None
    wanted = _connections(pid, port)
    if not wanted:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    seen = on = 0
    try:
        for fd in fds:
            if seen >= limit:
                break
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if not (link.startswith("socket:[") and int(link[8:-1]) in wanted):
                continue
            mine = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
            if mine < 0:
                continue  # refused, or closed meanwhile
            sock = socket.socket(fileno=mine)  # our duplicate: closing it leaves the server's open
            try:
                on += bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                seen += 1
            except OSError:
                pass
            finally:
                sock.close()
    finally:
        os.close(pidfd)
    return {"connections": seen, "nodelay": on} if seen else None
