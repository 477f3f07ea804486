"""Schema versions: fresh files, newer files refused, older files migrated, foreign files named."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from types import ModuleType

import pytest

from infra_agent.errors import InfraAgentError
from infra_agent.ledger import SCHEMA_VERSION, Ledger, LedgerError, SchemaTooNew, schema


def _q(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql).fetchall()


def _set_version(path: Path, version: int) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))


def test_fresh_ledger_records_its_version(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "dir" / "ledger.db"
    Ledger(db).close()
    assert _q(db, "SELECT value FROM meta WHERE key = 'schema_version'") == [(str(SCHEMA_VERSION),)]
    assert [r[0] for r in _q(db, "SELECT version FROM migrations")] == [1]
    tables = {r[0] for r in _q(db, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"meta", "migrations", "runs", "experiments", "measurements", "findings", "artifacts",
            "run_state"} <= tables
    Ledger(db).close()  # reopening is a no-op
    assert len(_q(db, "SELECT version FROM migrations")) == 1


def test_empty_file_is_initialised(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    db.touch()
    with Ledger(db) as led:
        assert led.list_runs() == []


def test_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    Ledger(db).close()
    _set_version(db, SCHEMA_VERSION + 98)
    with pytest.raises(SchemaTooNew) as err:
        Ledger(db)
    msg = str(err.value)
    assert isinstance(err.value, InfraAgentError) and isinstance(err.value, LedgerError)
    assert str(db) in msg and f"schema version {SCHEMA_VERSION + 98}" in msg
    assert f"supports schema version {SCHEMA_VERSION}" in msg and "upgrade infra-agent" in msg
    assert err.value.found == SCHEMA_VERSION + 98 and err.value.supported == SCHEMA_VERSION
    assert _q(db, "SELECT value FROM meta WHERE key = 'schema_version'") == [(str(SCHEMA_VERSION + 98),)]


def test_older_schema_is_migrated(tmp_path: Path, fx: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "ledger.db"
    with Ledger(db) as led:
        led.create_run(fx.make_run())
        led.save_experiment(fx.make_experiment(seq=0))

    def add_label(conn: sqlite3.Connection) -> None:
        conn.execute("ALTER TABLE runs ADD COLUMN label TEXT")

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 2)
    monkeypatch.setitem(schema.MIGRATIONS, 2, schema.Migration("runs.label", add_label))
    with Ledger(db) as led:
        assert [e.id for e in led.experiments("run-1")] == ["run-1-e0"]
    assert _q(db, "SELECT value FROM meta WHERE key = 'schema_version'") == [("2",)]
    assert _q(db, "SELECT version, description FROM migrations ORDER BY version")[1] == (2, "runs.label")
    assert "label" in {r[1] for r in _q(db, "PRAGMA table_info(runs)")}


def test_a_failing_migration_leaves_the_old_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "ledger.db"
    Ledger(db).close()

    def half(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE extra (x)")
        raise LedgerError("migration 2 broke")

    monkeypatch.setattr(schema, "SCHEMA_VERSION", 3)
    monkeypatch.setitem(schema.MIGRATIONS, 2, schema.Migration("half", half))
    with pytest.raises(LedgerError, match="migration 2 broke"):
        Ledger(db)
    monkeypatch.delitem(schema.MIGRATIONS, 2)
    with pytest.raises(LedgerError, match="no migration to ledger schema version 2"):
        Ledger(db)
    assert _q(db, "SELECT value FROM meta WHERE key = 'schema_version'") == [("1",)]
    assert not _q(db, "SELECT name FROM sqlite_master WHERE name = 'extra'")


def test_random_bytes_are_not_a_ledger(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    db.write_bytes(os.urandom(8192))
    with pytest.raises(LedgerError) as err:
        Ledger(db)
    assert str(db) in str(err.value) and "not a database" in str(err.value)
    assert err.value.__suppress_context__  # the CLI shows the message, not a chained traceback


def test_foreign_sqlite_database_is_not_a_ledger(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE customers (id)")
    with pytest.raises(LedgerError, match=r"other\.db is a SQLite database but not an infra-agent ledger"):
        Ledger(db)
    assert {r[0] for r in _q(db, "SELECT name FROM sqlite_master")} == {"customers"}


def test_unusable_path_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(LedgerError, match="cannot create the ledger directory"):
        Ledger(tmp_path / "file" / "ledger.db")
    with pytest.raises(LedgerError, match=str(tmp_path)):
        Ledger(tmp_path)  # a directory
