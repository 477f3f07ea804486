"""A SIGKILLed run reads ``stale`` in the MCP ``list_runs`` tool as in ``infra-agent ls`` (issue #37).

Both ask one function (``agent/run_status.py``); before it, ``ls`` said ``stale`` and
``list_runs`` said ``running`` for the same run.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra_agent.mcp.session import McpSession

from ..security.cheats.kernel_workspace import kernel_workspace

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _running_run(db: Path) -> str | None:
    """The id of a run the ledger shows running with its owner recorded, read as another process would."""
    if not db.exists():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        row = con.execute("SELECT runs.id FROM runs JOIN run_state ON run_state.run_id = runs.id "
                          "WHERE runs.status = 'running' AND run_state.key = 'owner'").fetchone()
    except sqlite3.OperationalError:
        return None
    finally:
        con.close()
    return row[0] if row else None


def test_a_sigkilled_run_is_stale_in_ls_and_in_list_runs(tmp_path: Path) -> None:
    ws = kernel_workspace(tmp_path / "ws")
    db = ws / ".infra-agent" / "ledger.db"
    cmd = [sys.executable, "-m", "infra_agent.cli.main", "run", str(ws), "--proposer", "rules", "--budget-runs", "2",
           "--no-confirm", "--no-report"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        run_id = None
        while run_id is None and time.monotonic() < deadline and proc.poll() is None:
            run_id = _running_run(db)
            time.sleep(0.1)
        assert run_id is not None, (proc.poll(), proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "")
    finally:
        # The whole group: the run and the check workers it started.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    listed = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "ls", str(ws), "--json"],
                            capture_output=True, text=True, timeout=120, check=False)
    (row,) = json.loads(listed.stdout)
    assert row["id"] == run_id and row["stale"] is True, listed.stdout

    session = McpSession(ws)
    try:
        res = session.call("list_runs", {})
    finally:
        session.close()
    assert not res.error, res.text
    (shown,) = res.data["runs"]
    assert shown["id"] == run_id and shown["status"] == "stale" and shown["stale"] is True, shown
    assert shown["recorded_status"] == "running", shown
    assert f"{run_id} [rules] stale" in res.text and " running " not in res.text, res.text
