"""Process-group liveness and signalling, without psutil.

A server runs as the leader of its own session/process group so one signal reaches
everything it spawned.  "Alive" ignores zombies: when the container's PID 1 does not
reap orphans, a killed grandchild can linger as a zombie that still counts for
``killpg(pgid, 0)`` but holds no resources.

Ownership marks: every launched server's environment carries
``INFRA_AGENT_OWNER=<launcher pid>:<token>``.  ``find_owned_groups(token)`` and
``kill_owned_groups(token)`` find the groups a dead launcher left behind by that mark
(read from ``/proc/<pid>/environ``), never by a process name.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
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


# ------------------------------------------------------------ ownership marks

OWNER_ENV = "INFRA_AGENT_OWNER"
# Set this in the environment to give every server this process launches a known
# token, so a later process (an agent resuming a run) can find what is left of them.
OWNER_TOKEN_ENV = "INFRA_AGENT_OWNER_TOKEN"

_session_token: str | None = None


def default_owner_token() -> str:
    """``$INFRA_AGENT_OWNER_TOKEN``, else a random token fixed for this process's life."""
    global _session_token
    env = os.environ.get(OWNER_TOKEN_ENV)
    if env:
        return env
    if _session_token is None:
        _session_token = secrets.token_hex(8)
    return _session_token


def owner_mark(token: str, pid: int | None = None) -> str:
    """The value of ``INFRA_AGENT_OWNER`` for a server launched by ``pid`` (default: us)."""
    if not token or ":" in token or "\0" in token:
        raise ValueError(f"an owner token is a non-empty string without ':' or NUL, got {token!r}")
    return f"{os.getpid() if pid is None else pid}:{token}"


def _environ_owner(pid: int) -> str | None:
    try:
        data = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None  # gone, or another user's process
    prefix = OWNER_ENV.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, pgid) of ``pid``, or None when it is gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def find_owned_groups(token: str, *, orphaned_only: bool = False) -> list[int]:
    """Process groups holding a live process whose environment carries ``token``.

    Every server ``ServerProcess`` launches gets ``INFRA_AGENT_OWNER=<launcher pid>:<token>``
    in its environment, and its children inherit it, so this finds what a killed
    launcher left behind by the mark, never by a process name.  ``orphaned_only`` keeps
    only groups whose launcher is no longer alive.  Our own group is never listed.
    Needs ``/proc`` (Linux); elsewhere it finds nothing.
    """
    if not _PROC.is_dir():
        return []
    ours = os.getpgrp()
    groups: set[int] = set()
    live_owners: dict[int, bool] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        mark = _environ_owner(pid)
        if mark is None:
            continue
        owner, _, their_token = mark.partition(":")
        if their_token != token:
            continue
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X") or st[1] <= 1 or st[1] == ours:
            continue
        if orphaned_only and owner.isdigit():
            o = int(owner)
            if o not in live_owners:
                live_owners[o] = _alive(o)
            if live_owners[o]:
                continue
        groups.add(st[1])
    return sorted(groups)


def kill_owned_groups(token: str, *, orphaned_only: bool = True, grace_s: float = 5.0) -> list[int]:
    """Stop the groups ``find_owned_groups`` lists: SIGTERM, SIGKILL after ``grace_s``.

    By default only groups whose launcher is gone are touched, so a cleanup at the
    start of a resumed run cannot stop servers another live process is using.
    Returns the groups signalled.
    """
    groups = find_owned_groups(token, orphaned_only=orphaned_only)
    for pgid in groups:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pgid in groups:
        if group_alive(pgid):
            signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.02)
    return groups
