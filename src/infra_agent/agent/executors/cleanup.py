"""Finding and killing what an experiment left running.

Every process an experiment starts (the probe worker, the servers the worker
launches, whatever those spawn) inherits ``INFRA_AGENT_EXPERIMENT=<run>/<experiment>``
in its environment.  After a timeout, or when a run killed with SIGKILL is resumed,
the process groups holding that marker are killed, and nothing else: the marker is
specific to one run, so another user's processes (or another run's) are never
touched.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

MARKER_ENV = "INFRA_AGENT_EXPERIMENT"
_PROC = Path("/proc")
_PR_SET_PDEATHSIG = 1


def marked_pids(prefix: str) -> list[int]:
    """PIDs marked with ``prefix`` (zombies excluded): a whole run's (``<run>/``, ending in a
    slash), or exactly one experiment's (``<run>/e1``, which is not ``<run>/e12``)."""
    if not _PROC.is_dir():
        return []
    needle = f"{MARKER_ENV}={prefix}".encode()
    exact = not prefix.endswith("/")
    me = os.getpid()
    out: list[int] = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].split()[0] in ("Z", "X"):
            continue
        if any(item == needle if exact else item.startswith(needle) for item in env.split(b"\0")):
            out.append(int(entry.name))
    return out


def kill_marked(prefix: str, timeout_s: float = 5.0) -> int:
    """SIGKILL every process group holding the marker; returns how many processes were found."""
    pids = marked_pids(prefix)
    for pid in pids:
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        try:
            os.killpg(pgid, signal.SIGKILL) if pgid != os.getpgid(0) else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while marked_pids(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(pids)


PARENT_ENV = "INFRA_AGENT_PARENT_PID"


def die_with_parent(parent: int | None = None) -> None:
    """Called first thing in a child: SIGKILL this process when its parent exits (Linux).

    It runs in the child itself rather than as a ``preexec_fn`` (unsafe between fork and
    exec when the parent has threads).  The parent may already have died before the
    call: then the child exits at once.  Elsewhere the marker-based cleanup on resume
    is what remains."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    expected = parent if parent is not None else int(os.environ.get(PARENT_ENV, "0") or 0)
    if expected and os.getppid() != expected:
        os._exit(137)
