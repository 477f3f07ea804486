"""A launched server's log file on disk: its secrets masked, every other byte as printed, never a full pipe."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from infra_agent.errors import ServerStartError
from infra_agent.safety import MASK
from infra_agent.target import ServerProcess
from infra_agent.target.server_log import ServerLog
from infra_agent.workspace import ServerTargetSpec

PY = sys.executable
CMD_KEY = "sk-live-FAKEcmd0123456789"
ENV_TOKEN = "svc-FAKE-9a8b7c6d5e4f3210"

# Prints its secrets among ordinary lines, a line that is not UTF-8 and a last line without
# its end, then fails before it is ready.
CARELESS = r"""
import os, sys
out = sys.stdout.buffer
out.write(b"loading weights\n")
out.write(("api key: " + sys.argv[sys.argv.index("--api-key") + 1] + "\n").encode())
out.write(("token " + os.environ["SERVICE_TOKEN"] + " in use\n").encode())
out.write(b"latin-1 bytes: caf\xe9\n")
out.write(b"per_token_ms = 0.25\n")
out.flush()
sys.stderr.write("fatal: no GPU")
sys.exit(3)
"""


def _spec(command: list[str], **kw: object) -> ServerTargetSpec:
    fields: dict[str, object] = {"kind": "server", "command": command, "ready_url": "/", "ready_timeout_s": 20,
                                 "env": {"SERVICE_TOKEN": ENV_TOKEN}}
    fields.update(kw)
    return ServerTargetSpec.model_validate(fields)


def test_the_secrets_a_server_prints_are_masked_in_its_log_file(tmp_path: Path, reap: list[int]) -> None:
    server = ServerProcess(_spec([PY, "-c", CARELESS, "--api-key", CMD_KEY]), {}, tmp_path, root=tmp_path)
    with pytest.raises(ServerStartError) as info:
        with server:
            pass
    if server.pgid is not None:
        reap.append(server.pgid)
    assert info.value.exit_code == 3
    assert server.log_path is not None
    data = server.log_path.read_bytes()
    assert CMD_KEY.encode() not in data and ENV_TOKEN.encode() not in data
    assert f"api key: {MASK}\n".encode() in data and f"token {MASK} in use\n".encode() in data
    # The other lines are byte for byte what the server printed, the last one without its newline.
    assert data.startswith(b"# argv: ")
    assert b"\nloading weights\n" in data and b"\nlatin-1 bytes: caf\xe9\n" in data
    assert b"\nper_token_ms = 0.25\n" in data and data.endswith(b"fatal: no GPU")
    assert "fatal: no GPU" in info.value.log_tail


def test_a_server_that_prints_a_lot_before_it_is_ready_never_blocks(tmp_path: Path, reap: list[int]) -> None:
    # Far more than a pipe holds (64 KiB): a launcher that stopped reading would hang the
    # server before it ever served, and the start would time out.
    script = tmp_path / "chatty.py"
    script.write_text("import runpy, sys\n"
                      "for i in range(40000): print(f'line {i:06d} of the model load, padded to some length')\n"
                      "sys.argv = ['http.server', sys.argv[1], '--bind', '127.0.0.1']\n"
                      "runpy.run_module('http.server', run_name='__main__')\n")
    with ServerProcess(_spec([PY, str(script), "{port}"]), {}, tmp_path, root=tmp_path) as server:
        assert server.pid is not None
        reap.append(server.pid)
    assert server.log_path is not None
    lines = server.log_path.read_text().splitlines()
    printed = [line for line in lines if line.startswith("line ")]
    assert len(printed) == 40000 and printed[-1].startswith("line 039999 ")


def test_a_secret_split_between_two_writes_is_masked_whole(tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    # A long quiet_s: the first half must wait for the rest of its line however slow this machine is.
    log = ServerLog(tmp_path / "server.log", [CMD_KEY], quiet_s=60.0)
    log.note("# argv: ...\n")
    log.follow(os.fdopen(read_fd, "rb", buffering=0))
    os.write(write_fd, f"the key is {CMD_KEY[:10]}".encode())
    os.write(write_fd, f"{CMD_KEY[10:]}, keep it\nready\n".encode())
    log.settle()
    # Settled while the pipe is still open: what was written so far is on disk.
    assert (tmp_path / "server.log").read_text() == f"# argv: ...\nthe key is {MASK}, keep it\nready\n"
    os.write(write_fd, b"no end of line")
    os.close(write_fd)
    log.close()
    assert (tmp_path / "server.log").read_text().endswith("ready\nno end of line")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device every write to fails")
def test_the_writer_keeps_draining_when_its_file_cannot_be_written() -> None:
    read_fd, write_fd = os.pipe()
    log = ServerLog(Path("/dev/full"), [])  # every write: ENOSPC, as on a full disk
    log.follow(os.fdopen(read_fd, "rb", buffering=0))
    # Far past a pipe's capacity: these writes return only while the reader still drains.
    writer = threading.Thread(target=lambda: [os.write(write_fd, b"x" * 1023 + b"\n") for _ in range(1024)], daemon=True)
    writer.start()
    writer.join(timeout=30)
    assert not writer.is_alive()
    os.close(write_fd)
    log.close()
