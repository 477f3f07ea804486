"""``infra-agent resume`` after SIGKILL: no finished experiment lost or repeated, nothing left over."""

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

from infra_agent.agent.executors.cleanup import marked_pids
from infra_agent.ledger import Ledger
from infra_agent.standin.server import serve_standin

from .loop_workspace import git, llm_script, make_workspace

pytestmark = pytest.mark.slow


def _running_experiment(db: Path) -> tuple[str, str] | None:
    """(run id, experiment id) of an experiment the ledger shows running, read as another process would."""
    if not db.exists():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        row = con.execute("SELECT run_id, id FROM experiments WHERE status = 'running' AND id != 'e0'").fetchone()
    except sqlite3.OperationalError:
        return None
    finally:
        con.close()
    return (row[0], row[1]) if row else None


def _wait_for_servers(run_id: str, exp_id: str, deadline: float) -> None:
    """Until a process marked with the experiment is up (its probe worker and servers)."""
    while len(marked_pids(f"{run_id}/{exp_id}")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(f"{run_id}/{exp_id}"), "the experiment never started its processes"


def test_sigkill_mid_experiment_then_resume(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path / "ws")
    db = ws / ".infra-agent" / "ledger.db"
    with serve_standin(llm_script()) as url:
        cmd = [sys.executable, "-m", "infra_agent.cli.main", "run", str(ws), "--proposer", "llm", "--model", "standin",
               "--base-url", url, "--budget-runs", "3", "--no-confirm", "--no-report"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 240
        found = None
        while found is None and time.monotonic() < deadline and proc.poll() is None:
            found = _running_experiment(db)
            time.sleep(0.2)
        assert found is not None, (proc.poll(), proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "")
        run_id, exp_id = found
        wt_dir = ws / ".infra-agent" / "worktrees" / run_id
        # Kill it while the experiment runs: its worktrees exist and its servers are up.
        # Act as soon as the experiment's servers are up (its worktrees exist by then): on
        # an idle machine the whole A/B takes only seconds, so a fixed sleep could miss it.
        _wait_for_servers(run_id, exp_id, deadline)
        with Ledger.for_workspace(ws) as ledger:
            before = {e.id: e for e in ledger.experiments(run_id)}
        assert before["e0"].status == "done" and before[exp_id].status == "running"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The worker dies with its parent, and the servers with the worker.
        gone = time.monotonic() + 30
        while marked_pids(f"{run_id}/") and time.monotonic() < gone:
            time.sleep(0.2)
        assert marked_pids(f"{run_id}/") == [], "processes of the killed run outlived it"
        assert wt_dir.exists()  # SIGKILL leaves the worktree: resume must remove it
        # `ls` tells the killed run from a running one: its owner process is gone.
        listed = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "ls", str(ws), "--json"],
                                capture_output=True, text=True, timeout=120, check=False)
        row, = json.loads(listed.stdout)
        assert row["status"] == "running" and row["stale"] is True, listed.stdout
        human = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "ls", str(ws)], capture_output=True,
                               text=True, timeout=120, check=False, env={**os.environ, "COLUMNS": "250"})
        assert "stale" in human.stdout and " running " not in human.stdout, human.stdout

        out = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "resume", run_id, "--workspace", str(ws),
                              "--json", "--no-report"], capture_output=True, text=True, timeout=600, check=False)
    record = json.loads(out.stdout)
    assert record["status"] == "done", out.stderr[-3000:]
    # 0 only when every gate of the final table passes; 3 when the run ended with one that does not.
    failing = [g for g in record["gates_after"] if g["outcome"] not in ("pass", "skipped")]
    assert out.returncode == (3 if failing else 0), (out.returncode, out.stderr[-3000:])
    with Ledger.for_workspace(ws) as ledger:
        after = {e.id: e for e in ledger.experiments(run_id)}
    # The finished baseline was kept, not measured again; the interrupted experiment ran once, to the end.
    assert after["e0"].started_at == before["e0"].started_at and after["e0"].finished_at == before["e0"].finished_at
    assert after[exp_id].status == "done" and after[exp_id].accepted
    assert [e.id for e in after.values() if e.role == "experiment"] == [exp_id]
    # Nothing left over: no process, no worktree, no temporary branch.
    assert marked_pids(f"{run_id}/") == []
    assert not wt_dir.exists()
    assert git(ws, "worktree", "list").strip().count("\n") == 0
    assert git(ws, "branch", "--list", f"infra-agent/{run_id}-*").strip() == ""


def test_ctrl_c_leaves_a_resumable_ledger_and_nothing_running(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path / "ws")
    db = ws / ".infra-agent" / "ledger.db"
    with serve_standin(llm_script()) as url:
        cmd = [sys.executable, "-m", "infra_agent.cli.main", "run", str(ws), "--proposer", "llm", "--model", "standin",
               "--base-url", url, "--budget-runs", "3", "--no-confirm", "--no-report"]
        # SIGINT at its default, as in a terminal: a background job inherits it ignored.
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
        deadline = time.monotonic() + 240
        found = None
        while found is None and time.monotonic() < deadline and proc.poll() is None:
            found = _running_experiment(db)
            time.sleep(0.2)
        assert found is not None
        run_id, exp_id = found
        _wait_for_servers(run_id, exp_id, deadline)
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err.decode()[-3000:])
    assert "resume with `infra-agent resume" in err.decode()
    with Ledger.for_workspace(ws) as ledger:
        run = ledger.get_run(run_id)
        exps = {e.id: e for e in ledger.experiments(run_id)}
    assert run.status == "interrupted"
    assert exps["e0"].status == "done" and not exps[exp_id].finished
    assert marked_pids(f"{run_id}/") == []
    assert not (ws / ".infra-agent" / "worktrees" / run_id).exists()
    assert git(ws, "worktree", "list").strip().count("\n") == 0
