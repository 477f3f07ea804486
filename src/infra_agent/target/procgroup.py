"""Process-group liveness and signalling, without psutil.

A server runs as the leader of its own session/process group so one signal reaches
everything it spawned.  "Alive" ignores zombies: when the container's PID 1 does not
reap orphans, a killed grandchild can linger as a zombie that still counts for
``killpg(pgid, 0)`` but holds no resources.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

_PROC = Path("/proc")


def group_members(pgid: int) -> list[int]:
    """PIDs of the non-zombie processes in group ``pgid``."""
    if not _PROC.is_dir():
        # No /proc (macOS): fall back to "does any process, zombie or not, remain".
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members: list[int] = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # comm (field 2) may hold spaces and parens: split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the group; a group that is already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
