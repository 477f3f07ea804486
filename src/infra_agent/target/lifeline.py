"""The lifeline: stop a server's process group once the process that launched it is gone.

``ServerProcess`` starts this script (standard library only, run with ``python -I -S``)
in a session of its own, with the read end of a pipe as its stdin; only the launcher
holds the write end.  The kernel closes that end however the launcher ends, SIGKILL
included, so the lifeline then reads EOF, and it stops the group: SIGTERM, SIGKILL after
the grace period.  A launcher that stops the server itself writes one byte first, which
disarms the lifeline.  Unlike a parent-death signal, this reaches every member of the
group (a shell's children, a server's workers) and works where ``prctl`` does not exist.

Usage: ``python -I -S lifeline.py PGID GRACE_S`` (stdin: the pipe).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

_POLL_S = 1.0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _say(text: str) -> None:
    # stderr is the server's log file: leave a line there saying who stopped it.
    try:
        sys.stderr.write(f"# infra-agent lifeline: {text}\n")
        sys.stderr.flush()
    except OSError:
        pass


def watch(fd: int, pgid: int, grace_s: float) -> int:
    while True:
        readable, _, _ = select.select([fd], [], [], _POLL_S)
        if readable:
            if os.read(fd, 64):
                return 0  # disarmed: the launcher stops the server itself
            break  # EOF: the launcher is gone
        if not _group_alive(pgid):
            return 0  # nothing left to watch
    if not _group_alive(pgid):
        return 0
    _say(f"the launching process is gone; stopping process group {pgid}")
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return 0


def main(argv: list[str]) -> int:
    # Our own session keeps a terminal's signals away; ignore them anyway, a lifeline
    # must only end by its pipe or by the group's end.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return watch(0, int(argv[1]), float(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
