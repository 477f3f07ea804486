"""``infra-agent ls``: a run whose owner process died is shown ``stale``; one line of message per run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from infra_agent.records import RunRecord
from infra_agent.agent.runner import _start_time
from infra_agent.cli.main import app
from infra_agent.ledger import Ledger


def _record(ledger: Ledger, run_id: str, pid: int, message: str) -> None:
    ledger.create_run(RunRecord(id=run_id, workspace="ws", proposer="rules", started_at=time.time(), message=message))
    ledger.set_state(run_id, "owner", {"pid": pid, "host": socket.gethostname(), "start": _start_time(pid)})


def test_a_run_whose_owner_died_is_stale_and_a_live_one_is_running(tmp_path: Path) -> None:
    (tmp_path / ".infra-agent").mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        with Ledger(tmp_path / ".infra-agent" / "ledger.db") as ledger:
            _record(ledger, "r-alive", alive.pid, "measuring e1")
            _record(ledger, "r-dead", dead.pid,
                    "server exited before it was ready\nTraceback (most recent call last):\n  File x\nValueError: boom")
        dead.wait(timeout=30)
        listed = CliRunner().invoke(app, ["ls", str(tmp_path), "--json"])
        assert listed.exit_code == 0, listed.output
        rows = {r["id"]: r for r in json.loads(listed.stdout)}
        assert rows["r-dead"]["stale"] is True and rows["r-alive"]["stale"] is False
        assert rows["r-dead"]["status"] == rows["r-alive"]["status"] == "running"  # the record itself is unchanged

        human = CliRunner().invoke(app, ["ls", str(tmp_path)], env={"COLUMNS": "250"})
        lines = {line.split()[1]: line for line in human.stdout.splitlines() if "r-" in line}
        assert "stale" in lines["r-dead"] and "running" in lines["r-alive"], human.stdout
        # The message column: the first line only, never the traceback that followed it.
        assert "server exited before it was ready" in human.stdout
        assert "Traceback" not in human.stdout and "ValueError" not in human.stdout
    finally:
        alive.kill()
        alive.wait(timeout=30)
