"""A launcher killed with SIGKILL runs no cleanup code; its server must still go away.

Each test runs a real launcher process (a small script around ``ServerProcess``), kills
it with SIGKILL while the server serves, and watches what remains of the server's
process group: the parent-death signal stops the direct child, the lifeline the whole
group, and the ``INFRA_AGENT_OWNER`` mark lets a later process find what neither reached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra_agent.target import (
    ServerProcess,
    find_owned_groups,
    group_members,
    kill_owned_groups,
)
from infra_agent.target.procgroup import OWNER_ENV
from infra_agent.workspace import ServerTargetSpec

LAUNCHER = """
import sys, time
from infra_agent.target import ServerProcess
from infra_agent.workspace import ServerTargetSpec
log_dir, token, pdeathsig, lifeline = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"
spec = ServerTargetSpec(
    kind="server",
    # A shell with a child of its own: the parent-death signal cannot reach that child.
    command=["sh", "-c", "sleep 1000 & exec " + sys.executable + " -m http.server {port} --bind 127.0.0.1"],
    ready_url="/",
    ready_timeout_s=20,
    stop_grace_s=2,
)
with ServerProcess(spec, {}, log_dir, owner_token=token, parent_death_signal=pdeathsig, lifeline=lifeline) as server:
    print(server.pgid, server.url, flush=True)
    time.sleep(600)   # a long benchmark, ended by SIGKILL
"""


def _launch(tmp_path: Path, reap: list[int], token: str, *, pdeathsig: bool, lifeline: bool) -> tuple[subprocess.Popen[str], int, str]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "logs"), token, str(int(pdeathsig)), str(int(lifeline))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert launcher.stdout is not None
    line = launcher.stdout.readline().split()
    if len(line) != 2 or not line[0].isdigit():
        launcher.kill()
        launcher.wait()
        raise AssertionError(launcher.stderr.read() if launcher.stderr else line)
    pgid = int(line[0])
    reap.append(pgid)
    assert len(group_members(pgid)) == 2  # the server and its sleep child
    return launcher, pgid, line[1]


def _sigkill(launcher: subprocess.Popen[str]) -> None:
    launcher.send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=10) == -signal.SIGKILL


def _wait_gone(pgid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return group_members(pgid)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/", trust_env=False, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_sigkilled_launcher_leaves_no_server(tmp_path: Path, reap: list[int]) -> None:
    launcher, pgid, url = _launch(tmp_path, reap, "t-default", pdeathsig=True, lifeline=True)
    assert _answers(url)
    _sigkill(launcher)
    assert _wait_gone(pgid, timeout=5) == []  # the server and the shell's child
    assert not _answers(url)
    assert "lifeline: the launching process is gone" in next((tmp_path / "logs").glob("*.log")).read_text()


def test_lifeline_alone_stops_the_whole_group(tmp_path: Path, reap: list[int]) -> None:
    launcher, pgid, _ = _launch(tmp_path, reap, "t-lifeline", pdeathsig=False, lifeline=True)
    _sigkill(launcher)
    assert _wait_gone(pgid, timeout=5) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_parent_death_signal_alone_stops_the_server_but_not_a_grandchild(tmp_path: Path, reap: list[int]) -> None:
    launcher, pgid, url = _launch(tmp_path, reap, "t-pdeathsig", pdeathsig=True, lifeline=False)
    _sigkill(launcher)
    deadline = time.monotonic() + 5
    while pgid in group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = group_members(pgid)
    assert pgid not in left and not _answers(url)  # the direct child got SIGTERM
    assert len(left) == 1  # the shell's sleep: what only the lifeline (or the mark) reaches
    assert kill_owned_groups("t-pdeathsig", grace_s=1) == [pgid]
    assert _wait_gone(pgid, timeout=5) == []


def test_owner_mark_finds_what_an_unprotected_launch_leaves(tmp_path: Path, reap: list[int]) -> None:
    # Without either protection (the state before them), SIGKILL orphans the whole group.
    token = f"t-mark-{os.getpid()}"
    launcher, pgid, _ = _launch(tmp_path, reap, token, pdeathsig=False, lifeline=False)
    assert find_owned_groups(token) == [pgid]
    assert find_owned_groups(token, orphaned_only=True) == []  # its launcher still runs
    assert kill_owned_groups(token) == []  # so the default cleanup leaves it alone
    assert find_owned_groups("another-token") == []
    _sigkill(launcher)
    time.sleep(1.0)
    # Orphaned, still running.  (Not answering: its output pipe went with the launcher's log
    # writer, and http.server fails each request on its access-log line.)
    assert len(group_members(pgid)) == 2
    assert find_owned_groups(token, orphaned_only=True) == [pgid]
    assert kill_owned_groups(token, grace_s=2) == [pgid]
    assert group_members(pgid) == [] and find_owned_groups(token) == []


def test_the_mark_is_in_the_server_environment(tmp_path: Path, reap: list[int]) -> None:
    spec = ServerTargetSpec(kind="server", command=[sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
                            ready_url="/", ready_timeout_s=20)
    with ServerProcess(spec, {}, tmp_path, root=tmp_path, owner_token="t-env") as server:
        assert server.pid is not None
        reap.append(server.pid)
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        assert f"{OWNER_ENV}={os.getpid()}:t-env".encode() in environ
        assert find_owned_groups("t-env") == [server.pid]
    assert find_owned_groups("t-env") == []
    with pytest.raises(ValueError, match="owner token"):
        ServerProcess(spec, {}, tmp_path, owner_token="a:b")


def test_a_worker_thread_that_ends_does_not_take_the_server_along(tmp_path: Path, reap: list[int]) -> None:
    # The parent-death signal follows the launching *thread*; by default it is only set
    # from the main thread, so a server started by a short-lived thread keeps serving.
    import threading

    spec = ServerTargetSpec(kind="server", command=[sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"],
                            ready_url="/", ready_timeout_s=20)
    server = ServerProcess(spec, {}, tmp_path, root=tmp_path)
    worker = threading.Thread(target=server.start)
    worker.start()
    worker.join()
    try:
        assert server.pid is not None
        reap.append(server.pid)
        time.sleep(0.5)
        server.check_alive()
        assert _answers(server.url)
    finally:
        server.stop()
    assert group_members(server.pid) == []
