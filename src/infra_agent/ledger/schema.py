"""The ledger's SQLite schema: DDL, its version, and the migrations that reach it.

``MIGRATIONS[v]`` takes a database at version ``v - 1`` to version ``v`` (version 0 is
an empty file), so opening an older ledger replays only the steps it lacks.  The
version lives in ``meta.schema_version``; each applied step is recorded in
``migrations`` so a ledger's history can be inspected after the fact.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from infra_agent.ledger.errors import LedgerError, SchemaTooNew

SCHEMA_VERSION = 1


class Migration(NamedTuple):
    description: str
    apply: Callable[[sqlite3.Connection], None]


# Statements, not one script: ``executescript`` commits first, which would split a
# migration across transactions and leave a half-migrated file after a crash.
_V1: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS runs (
        id TEXT PRIMARY KEY,
        workspace TEXT NOT NULL,
        proposer TEXT NOT NULL,
        status TEXT NOT NULL,
        started_at REAL NOT NULL,
        finished_at REAL,
        data TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS runs_started ON runs (started_at)",
    # ``data`` is the whole Experiment as JSON (the source of truth); the other columns
    # are copies so queries (costs, trees, reports) need not parse every row.  An id is
    # unique within its run only (the loop numbers them e0, e1, ... in every run).
    """CREATE TABLE IF NOT EXISTS experiments (
        run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        id TEXT NOT NULL,
        seq INTEGER NOT NULL,
        parent TEXT,
        status TEXT NOT NULL,
        proposer TEXT NOT NULL,
        probe TEXT,
        tier TEXT,
        wall_s REAL NOT NULL DEFAULT 0,
        accepted INTEGER NOT NULL DEFAULT 0,
        started_at REAL,
        finished_at REAL,
        data TEXT NOT NULL,
        PRIMARY KEY (run_id, id)
    )""",
    "CREATE INDEX IF NOT EXISTS experiments_id ON experiments (id)",
    "CREATE INDEX IF NOT EXISTS experiments_run_seq ON experiments (run_id, seq)",
    "CREATE INDEX IF NOT EXISTS experiments_parent ON experiments (run_id, parent)",
    "CREATE INDEX IF NOT EXISTS experiments_probe ON experiments (probe, tier)",
    # Derived rows: rewritten from the experiment's Feedback on every save.  ``idx`` keeps
    # the order the probe reported them in.
    """CREATE TABLE IF NOT EXISTS measurements (
        run_id TEXT NOT NULL,
        exp_id TEXT NOT NULL,
        side TEXT NOT NULL CHECK (side IN ('candidate', 'baseline')),
        idx INTEGER NOT NULL,
        name TEXT NOT NULL,
        unit TEXT NOT NULL,
        tags TEXT NOT NULL,
        median REAL,
        ci_low REAL,
        ci_high REAL,
        n INTEGER NOT NULL,
        samples TEXT NOT NULL,
        PRIMARY KEY (run_id, exp_id, side, idx),
        FOREIGN KEY (run_id, exp_id) REFERENCES experiments (run_id, id) ON DELETE CASCADE
    )""",
    "CREATE INDEX IF NOT EXISTS measurements_name ON measurements (name)",
    """CREATE TABLE IF NOT EXISTS findings (
        run_id TEXT NOT NULL,
        exp_id TEXT NOT NULL,
        side TEXT NOT NULL CHECK (side IN ('candidate', 'baseline')),
        idx INTEGER NOT NULL,
        kind TEXT NOT NULL,
        severity TEXT NOT NULL,
        message TEXT NOT NULL,
        location TEXT,
        evidence TEXT NOT NULL,
        next_question TEXT,
        PRIMARY KEY (run_id, exp_id, side, idx),
        FOREIGN KEY (run_id, exp_id) REFERENCES experiments (run_id, id) ON DELETE CASCADE
    )""",
    "CREATE INDEX IF NOT EXISTS findings_kind ON findings (kind)",
    """CREATE TABLE IF NOT EXISTS artifacts (
        run_id TEXT NOT NULL,
        exp_id TEXT NOT NULL,
        side TEXT NOT NULL CHECK (side IN ('candidate', 'baseline')),
        idx INTEGER NOT NULL,
        kind TEXT NOT NULL,
        path TEXT NOT NULL,
        description TEXT NOT NULL,
        PRIMARY KEY (run_id, exp_id, side, idx),
        FOREIGN KEY (run_id, exp_id) REFERENCES experiments (run_id, id) ON DELETE CASCADE
    )""",
    # Proposer state (an LLM conversation, a study's trials) so a resumed run continues
    # where it stopped instead of starting its search over.
    """CREATE TABLE IF NOT EXISTS run_state (
        run_id TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (run_id, key)
    )""",
)


def _to_v1(conn: sqlite3.Connection) -> None:
    for stmt in _V1:
        conn.execute(stmt)


MIGRATIONS: dict[int, Migration] = {
    1: Migration("initial schema: runs, experiments, measurements, findings, artifacts, run_state", _to_v1),
}

_BOOKKEEPING: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS migrations (
        version INTEGER PRIMARY KEY,
        description TEXT NOT NULL,
        applied_at REAL NOT NULL
    )""",
)


def stored_version(conn: sqlite3.Connection, path: Path) -> int:
    """The file's schema version: 0 for an empty database; refuses foreign databases."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "meta" not in tables:
        if tables:
            # Someone else's database: writing our tables into it would be a surprise.
            raise LedgerError(
                f"{path} is a SQLite database but not an infra-agent ledger (it has tables "
                f"{sorted(tables)[:5]} and no 'meta' table); choose another ledger path"
            )
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        raise LedgerError(f"ledger {path} has a 'meta' table without a schema_version; the file is damaged")
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise LedgerError(f"ledger {path} has schema_version {row[0]!r}, expected an integer") from None


def ensure_schema(conn: sqlite3.Connection, path: Path) -> int:
    """Bring the file to ``SCHEMA_VERSION``; refuse a newer one.  Returns the version.

    ``conn`` must be in autocommit mode (``isolation_level=None``): the migration runs
    in one explicit transaction, so a crash leaves the file at the old version, whole.
    """
    # Read the module globals at call time so a test can add a migration.
    target = SCHEMA_VERSION
    found = stored_version(conn, path)
    if found > target:
        raise SchemaTooNew(path, found, target)
    if found == target:
        return found
    # IMMEDIATE takes the write lock now, then we look again: another process opening
    # the same new file may have migrated it while we waited.
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = stored_version(conn, path)
        if found > target:
            raise SchemaTooNew(path, found, target)
        for stmt in _BOOKKEEPING:
            conn.execute(stmt)
        for version in range(found + 1, target + 1):
            step = MIGRATIONS.get(version)
            if step is None:
                raise LedgerError(f"no migration to ledger schema version {version} (from {version - 1}); "
                                  f"cannot upgrade {path}")
            step.apply(conn)
            conn.execute("INSERT OR REPLACE INTO migrations (version, description, applied_at) VALUES (?, ?, ?)",
                         (version, step.description, time.time()))
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)", (str(target),))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return target
