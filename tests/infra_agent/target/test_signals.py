"""A parent using ServerProcess that gets Ctrl-C (SIGINT) or SIGTERM leaves no orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra_agent.target import group_members

PARENT = """
import signal, sys, time
# A shell started in the background may hand us SIGINT ignored; an interactive
# `python script.py` has Python's default handler, which is what Ctrl-C meets.
signal.signal(signal.SIGINT, signal.default_int_handler)
from infra_agent.target import ServerProcess
from infra_agent.workspace import ServerTargetSpec
spec = ServerTargetSpec(
    kind="server",
    command=["sh", "-c", "sleep 1000 & exec " + sys.executable + " -m http.server {port} --bind 127.0.0.1"],
    ready_url="/",
    ready_timeout_s=20,
    stop_grace_s=5,
)
with ServerProcess(spec, {}, sys.argv[1]) as server:
    print(server.pgid, flush=True)
    time.sleep(600)   # a long benchmark, interrupted by the signal
"""


@pytest.mark.parametrize(
    ("sig", "expected_rc"),
    [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, 128 + signal.SIGTERM)],
    ids=["ctrl-c", "sigterm"],
)
def test_signalled_parent_leaves_no_orphan(tmp_path: Path, reap: list[int], sig: signal.Signals, expected_rc: int) -> None:
    parent, pgid = _start_parent(PARENT, tmp_path, reap)
    try:
        assert len(group_members(pgid)) == 2  # the server and its child are running
        parent.send_signal(sig)
        rc = parent.wait(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    # Ctrl-C: KeyboardInterrupt unwinds, Python then exits by SIGINT as convention asks.
    # SIGTERM: turned into SystemExit(143) while the block is active.
    assert rc == expected_rc
    assert group_members(pgid) == []  # no live member, at once
    assert _group_reaped(pgid, timeout=10)  # and, once PID 1 reaps the orphaned zombies, no member at all


def _start_parent(code: str, tmp_path: Path, reap: list[int]) -> tuple[subprocess.Popen[str], int]:
    """Run ``code`` (a ServerProcess user) and read the server's process group id it prints."""
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    if not line.strip().isdigit():
        parent.kill()
        parent.wait()
        raise AssertionError(parent.stderr.read() if parent.stderr else line)
    pgid = int(line)
    reap.append(pgid)
    return parent, pgid


def _group_reaped(pgid: int, timeout: float) -> bool:
    # This machine's PID 1 reaps orphans by polling (about a second here), so a
    # killed grandchild stays a zombie group member for a moment.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_double_ctrl_c_escalates_but_still_cleans_up(tmp_path: Path, reap: list[int]) -> None:
    # The server ignores SIGTERM, so stop() waits out its grace period; a second
    # Ctrl-C during that wait must skip to SIGKILL, not abandon the group.
    parent_code = PARENT.replace(
        '"sleep 1000 & exec " + sys.executable + " -m http.server {port} --bind 127.0.0.1"',
        '"trap \\"\\" TERM; sleep 1000 & exec " + sys.executable + " -c \\"import signal, runpy, sys; '
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); sys.argv = ['http.server', '{port}', '--bind', '127.0.0.1']; "
        "runpy.run_module('http.server', run_name='__main__')\\\"\"",
    ).replace("stop_grace_s=5", "stop_grace_s=60")
    assert parent_code != PARENT
    parent, pgid = _start_parent(parent_code, tmp_path, reap)
    try:
        parent.send_signal(signal.SIGINT)
        time.sleep(0.5)  # now inside the 60 s grace period
        assert parent.poll() is None and group_members(pgid)
        started = time.monotonic()
        parent.send_signal(signal.SIGINT)
        rc = parent.wait(timeout=20)
        assert time.monotonic() - started < 10
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert rc == -signal.SIGINT
    assert group_members(pgid) == []
