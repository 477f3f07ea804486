"""ServerProcess against real subprocesses: ready, early exit, hang, children, death mid-run."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra_agent.errors import ServerStartError
from infra_agent.target import ServerProcess, group_members
from infra_agent.workspace import ServerTargetSpec

PY = sys.executable
# A real HTTP server: GET / answers 200 (a directory listing).
HTTP_SERVER = [PY, "-m", "http.server", "{port}", "--bind", "127.0.0.1"]


def spec(command: str | list[str], **kw: object) -> ServerTargetSpec:
    fields: dict[str, object] = {"kind": "server", "command": command, "ready_url": "/", "ready_timeout_s": 20}
    fields.update(kw)
    return ServerTargetSpec.model_validate(fields)


def test_ready_server_serves_and_is_stopped(tmp_path: Path, reap: list[int]) -> None:
    with ServerProcess(spec(HTTP_SERVER, metrics_url="/metrics"), {}, tmp_path / "logs", root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.metrics_url == f"{server.url}/metrics"
        assert httpx.get(server.url + "/", trust_env=False).status_code == 200
        server.check_alive()
        assert server.log_path is not None and server.log_path.parent == tmp_path / "logs"
        pgid = server.pgid
        assert pgid is not None and os.getpgid(server.pid) == pgid  # its own group
        assert os.getsid(server.pid) != os.getsid(0)  # and its own session
    assert group_members(pgid) == []
    assert "GET / HTTP" in server.log_tail()  # the access log went to the file


def test_knob_values_reach_the_command(tmp_path: Path, reap: list[int]) -> None:
    served = tmp_path / "served dir"
    served.mkdir()
    (served / "marker.txt").write_text("hello")
    server_spec = spec([*HTTP_SERVER, "--directory", "{root_dir}"])
    with ServerProcess(server_spec, {"root_dir": str(served)}, tmp_path, root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        assert httpx.get(server.url + "/marker.txt", trust_env=False).text == "hello"
        assert server.argv[-1] == str(served)


def test_early_exit_raises_with_exit_code_and_log_tail(tmp_path: Path, reap: list[int]) -> None:
    crash = [PY, "-c", "import sys; print('loading weights'); print('fatal: no GPU', file=sys.stderr); sys.exit(3)"]
    server = ServerProcess(spec(crash), {}, tmp_path, root=tmp_path)
    with pytest.raises(ServerStartError) as info:
        with server:
            pass
    err = info.value
    assert err.exit_code == 3
    assert "loading weights" in err.log_tail and "fatal: no GPU" in err.log_tail
    assert err.log_path == str(server.log_path)
    assert "exited before it was ready" in str(err) and "fatal: no GPU" in str(err)


def test_never_ready_times_out_and_the_group_is_gone(tmp_path: Path, reap: list[int]) -> None:
    # Listens nowhere; its child would outlive a leader-only kill.
    hang = ["sh", "-c", f"sleep 1000 & {PY} -c \"print('warming up', flush=True); import time; time.sleep(1000)\""]
    server = ServerProcess(spec(hang, ready_timeout_s=1.0), {}, tmp_path, root=tmp_path)
    started = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        server.start()
    assert server.pgid is not None
    reap.append(server.pgid)
    assert 1.0 <= time.monotonic() - started < 15
    assert "not ready after 1s" in str(info.value)
    assert "warming up" in info.value.log_tail
    assert group_members(server.pgid) == []


def test_child_processes_do_not_outlive_the_server(tmp_path: Path, reap: list[int]) -> None:
    command = ["sh", "-c", f"sleep 1000 & exec {PY} -m http.server {{port}} --bind 127.0.0.1"]
    with ServerProcess(spec(command), {}, tmp_path, root=tmp_path) as server:
        pgid = server.pgid
        assert pgid is not None
        reap.append(pgid)
        members = group_members(pgid)
        assert len(members) == 2 and server.pid in members  # the server and its sleep child
    assert group_members(pgid) == []
    for pid in members:
        assert _gone_or_zombie(pid)


def _gone_or_zombie(pid: int) -> bool:
    # This container's PID 1 may not reap orphans, so a killed grandchild can stay a
    # zombie: dead, holding nothing, but still listed.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def test_server_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path, reap: list[int]) -> None:
    code_ignoring_term = (
        "import signal, sys, runpy; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "sys.argv = ['http.server', sys.argv[1], '--bind', '127.0.0.1']; runpy.run_module('http.server', run_name='__main__')"
    )
    stubborn = [PY, "-c", code_ignoring_term, "{port}"]
    server = ServerProcess(spec(stubborn, stop_grace_s=0.5), {}, tmp_path, root=tmp_path).start()
    assert server.pgid is not None
    reap.append(server.pgid)
    started = time.monotonic()
    code = server.stop()
    assert 0.5 <= time.monotonic() - started < 10
    assert code == -signal.SIGKILL
    assert group_members(server.pgid) == []
    assert server.stop() == code  # idempotent


def test_check_alive_reports_a_server_that_died(tmp_path: Path, reap: list[int]) -> None:
    with ServerProcess(spec(HTTP_SERVER), {}, tmp_path, root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(ServerStartError) as info:
            while time.monotonic() < deadline:
                server.check_alive()
                time.sleep(0.02)
        assert info.value.exit_code == -signal.SIGKILL
        assert "exited while running" in str(info.value)


def test_exception_in_the_block_still_stops_the_group(tmp_path: Path, reap: list[int]) -> None:
    with pytest.raises(RuntimeError, match="benchmark blew up"):
        with ServerProcess(spec(HTTP_SERVER), {}, tmp_path, root=tmp_path) as server:
            assert server.pgid is not None
            reap.append(server.pgid)
            raise RuntimeError("benchmark blew up")
    assert group_members(server.pgid) == []


def test_port_taken_by_someone_else_is_retried(tmp_path: Path, reap: list[int]) -> None:
    # First launch reports the port as taken (as a server losing the bind race would);
    # the second serves.  A marker file tells the two launches apart.
    script = tmp_path / "flaky.py"
    script.write_text(
        "import pathlib, runpy, sys\n"
        "marker = pathlib.Path(sys.argv[2])\n"
        "if not marker.exists():\n"
        "    marker.touch()\n"
        "    sys.exit('OSError: [Errno 98] Address already in use')\n"
        "sys.argv = ['http.server', sys.argv[1], '--bind', '127.0.0.1']\n"
        "runpy.run_module('http.server', run_name='__main__')\n"
    )
    with ServerProcess(spec([PY, str(script), "{port}", str(tmp_path / "marker")]), {}, tmp_path / "logs", root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        assert httpx.get(server.url + "/", trust_env=False).status_code == 200
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert len(logs) == 2 and any("Address already in use" in p.read_text() for p in logs)


def test_missing_executable_is_a_server_start_error(tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match="cannot launch 'no-such-binary-here'"):
        ServerProcess(spec(["no-such-binary-here", "{port}"]), {}, tmp_path, root=tmp_path).start()


def test_signal_handlers_are_restored(tmp_path: Path, reap: list[int]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with ServerProcess(spec(HTTP_SERVER), {}, tmp_path, root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
        during = signal.getsignal(signal.SIGTERM)
        if before is signal.SIG_DFL:
            assert during is not signal.SIG_DFL  # installed only while the block runs
    assert signal.getsignal(signal.SIGTERM) is before
