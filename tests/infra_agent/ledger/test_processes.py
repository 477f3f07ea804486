"""Real second processes: a reader while a writer holds the lock, and a writer SIGKILLed mid-run."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from infra_agent.ledger import Ledger

CHILD = Path(__file__).with_name("ledger_child.py")


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_reader_is_not_blocked_by_an_open_write_transaction(tmp_path: Path, fx: ModuleType) -> None:
    db = tmp_path / "ledger.db"
    with Ledger(db) as led:
        led.create_run(fx.make_run())
        led.save_experiment(fx.make_experiment(seq=0))
        # EXCLUSIVE would lock readers out of a rollback-journal database; in WAL mode
        # they read the last committed state meanwhile.
        writer = sqlite3.connect(db, isolation_level=None)
        writer.execute("BEGIN EXCLUSIVE")
        writer.execute("INSERT INTO runs (id, workspace, proposer, status, started_at, data) "
                       "VALUES ('uncommitted', '/', 'x', 'running', 5000, '{}')")
        try:
            proc = _child("read", str(db))
            out, err = proc.communicate(timeout=20)
        finally:
            writer.execute("ROLLBACK")
            writer.close()
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["runs"] == ["run-1"] and seen["snapshots"] == [["run-1-e0"]]
    assert seen["seconds"] < 5  # did not sit out the busy timeout


def test_readers_see_whole_experiments_while_parent_writes(tmp_path: Path, fx: ModuleType) -> None:
    db = tmp_path / "ledger.db"
    with Ledger(db) as led:
        led.create_run(fx.make_run())
        led.save_experiment(fx.make_experiment(seq=0))
        readers = [_child("read", str(db), "3") for _ in range(2)]
        seq = 1
        # Keep writing for as long as the readers read (each until it has seen 3 different
        # committed states), so their reads overlap the writes.
        while any(p.poll() is None for p in readers) and seq < 3000:
            led.save_experiment(fx.make_experiment(seq=seq, n_measurements=5, n_samples=20))
            seq += 1
        results = [p.communicate(timeout=20) + (p.returncode,) for p in readers]
    for out, err, rc in results:
        assert rc == 0, err
        snapshots = json.loads(out)["snapshots"]
        # Each read is a committed prefix of the writes, every experiment decoded whole.
        for exps in snapshots:
            assert exps == [f"run-1-e{i}" for i in range(len(exps))] and exps
        assert len(snapshots) >= 3, "the reader saw no writes land while it was reading"


def test_sigkilled_writer_leaves_finished_experiments_intact(tmp_path: Path, fx: ModuleType) -> None:
    db = tmp_path / "ledger.db"
    with Ledger(db) as led:
        led.create_run(fx.make_run())
    proc = _child("write", str(db), "100000")
    assert proc.stdout is not None
    reported: list[int] = []
    deadline = time.monotonic() + 20
    while len(reported) < 8 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        reported.append(int(line.split()[1]))
    os.kill(proc.pid, signal.SIGKILL)
    rest, _ = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert len(reported) == 8, "the child did not report 8 saves"
    # Saves it reported while the kill was on its way.
    reported += [int(line.split()[1]) for line in rest.splitlines()]

    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with Ledger(db) as led:
        got = led.experiments("run-1")
        # At most one save beyond the last report: committed but killed before printing.
        assert len(reported) <= len(got) <= len(reported) + 1
        for exp in got:
            want = fx.make_experiment(seq=exp.seq, n_measurements=40, n_samples=200)
            assert exp == want
            assert led.findings(exp.id) == want.feedback.findings
        counts = led._read("SELECT exp_id, COUNT(*) AS n FROM measurements GROUP BY exp_id")
        assert {r["exp_id"]: r["n"] for r in counts} == {e.id: 41 + 2 for e in got}
        assert led.next_seq("run-1") == len(got)
