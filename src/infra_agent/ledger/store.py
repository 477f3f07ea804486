"""The Ledger: every run and experiment, durable across crashes, readable while written.

SQLite in WAL mode so a report or ``status`` command can read while a run writes, and
``synchronous=FULL`` so a committed experiment survives power loss, not only a killed
process: a resumed run must never repeat a finished experiment, and one fsync per
experiment is nothing next to what an experiment costs.  Each save is one transaction,
so a SIGKILL leaves either the whole experiment or the previous version of it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError
from typing_extensions import Self

from infra_agent.feedback import Finding
from infra_agent.ledger import codec, schema
from infra_agent.ledger.costs import ProbeCost, probe_costs
from infra_agent.ledger.errors import LedgerError
from infra_agent.ledger.secrets import ledger_workspace_secrets
from infra_agent.records import FINISHED, Experiment, RunRecord
from infra_agent.vocabulary import FindingKind

log = logging.getLogger(__name__)

LEDGER_DIR = ".infra-agent"
LEDGER_FILE = "ledger.db"
# How long a writer waits for another process's transaction before giving up.  Saves
# are milliseconds long, so reaching this means a stuck process, not contention.
BUSY_TIMEOUT_S = 30.0
_KNOWN_IDS_SHOWN = 10

M = TypeVar("M", bound=BaseModel)


class Ledger:
    """One ledger file.  Safe to share between threads; open one per process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().absolute()
        # One connection guarded by a lock: sqlite3 connections must not be used by two
        # threads at once, and executors may report from worker threads.
        self._lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LedgerError(f"cannot create the ledger directory {self.path.parent}: {e}") from None
        self._conn: sqlite3.Connection | None = None
        # Masked by value in everything written, besides the environment's secrets.
        self.secrets = ledger_workspace_secrets(self.path, LEDGER_DIR)
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves, so the module never
            # opens a transaction behind our back.
            conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as e:
            raise LedgerError(f"cannot open ledger {self.path}: {e}") from None
        try:
            self._setup(conn)
        except LedgerError:
            conn.close()
            raise
        except sqlite3.DatabaseError as e:
            conn.close()
            # Typically "file is not a database": a stray file at the ledger's path.
            raise LedgerError(f"cannot use {self.path} as a ledger: {e}; "
                              f"move the file aside or choose another ledger path") from None
        self._conn = conn

    @classmethod
    def for_workspace(cls, root: str | Path) -> Ledger:
        """The workspace's ledger, ``<root>/.infra-agent/ledger.db``."""
        return cls(Path(root) / LEDGER_DIR / LEDGER_FILE)

    def _setup(self, conn: sqlite3.Connection) -> None:
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            # Network filesystems cannot do WAL; the ledger still works, but readers and
            # the writer will block each other.
            log.warning("ledger %s: journal_mode is %s, not wal (filesystem without shared memory?)",
                        self.path, mode)
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        schema.ensure_schema(conn, self.path)

    # ---- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Self:  # typing.Self needs 3.11; pydantic brings typing_extensions
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r})"

    # ---- plumbing ----------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise LedgerError(f"ledger {self.path} is closed")
        return self._conn

    @contextmanager
    def _write(self, what: str) -> Iterator[sqlite3.Connection]:
        """One transaction; rolled back whole on any error."""
        with self._lock:
            conn = self._connection()
            try:
                # IMMEDIATE takes the write lock up front, where busy_timeout waits for it;
                # a deferred transaction that upgrades later can fail at once with BUSY.
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise LedgerError(f"ledger {self.path}: cannot start to {what}: {e}") from None
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise LedgerError(f"ledger {self.path}: failed to {what}: {e}") from None
                raise

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            conn = self._connection()
            try:
                return conn.execute(sql, params).fetchall()
            except sqlite3.Error as e:
                raise LedgerError(f"ledger {self.path}: read failed: {e}") from None

    def _decode(self, model: type[M], data: str | dict[str, Any], what: str) -> M:
        try:
            return model.model_validate(json.loads(data) if isinstance(data, str) else data)
        except (ValueError, ValidationError) as e:
            raise LedgerError(f"ledger {self.path}: {what} cannot be read by this version of infra-agent: "
                              f"{e}") from None

    def _require_run(self, run_id: str) -> None:
        if not self._read("SELECT 1 FROM runs WHERE id = ?", (run_id,)):
            raise self._missing("run", run_id, "SELECT id FROM runs ORDER BY started_at DESC, rowid DESC")

    def _missing(self, kind: str, ident: str, known_sql: str, params: tuple[Any, ...] = ()) -> LedgerError:
        known = [r[0] for r in self._read(known_sql + f" LIMIT {_KNOWN_IDS_SHOWN + 1}", params)]
        if not known:
            listing = f"the ledger has no {kind}s"
        else:
            more = ", ..." if len(known) > _KNOWN_IDS_SHOWN else ""
            listing = f"known {kind}s (newest first): {', '.join(known[:_KNOWN_IDS_SHOWN])}{more}"
        return LedgerError(f"no {kind} {ident!r} in ledger {self.path}; {listing}")

    # ---- runs --------------------------------------------------------------------

    def _run_row(self, run: RunRecord) -> tuple[Any, ...]:
        data = codec.clean(run.model_dump(mode="json"), self.secrets)
        return (run.id, data["workspace"], data["proposer"], run.status, run.started_at, run.finished_at,
                codec.to_json(data))

    def create_run(self, run: RunRecord) -> None:
        row = self._run_row(run)
        with self._write(f"create run {run.id!r}") as conn:
            if self._read("SELECT 1 FROM runs WHERE id = ?", (run.id,)):
                raise LedgerError(f"run {run.id!r} already exists in ledger {self.path}")
            conn.execute("INSERT INTO runs (id, workspace, proposer, status, started_at, finished_at, data) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    def save_run(self, run: RunRecord) -> None:
        row = self._run_row(run)
        with self._write(f"save run {run.id!r}") as conn:
            conn.execute(
                "INSERT INTO runs (id, workspace, proposer, status, started_at, finished_at, data) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET workspace = excluded.workspace, "
                "proposer = excluded.proposer, status = excluded.status, started_at = excluded.started_at, "
                "finished_at = excluded.finished_at, data = excluded.data", row)

    def get_run(self, run_id: str) -> RunRecord:
        rows = self._read("SELECT data FROM runs WHERE id = ?", (run_id,))
        if not rows:
            raise self._missing("run", run_id, "SELECT id FROM runs ORDER BY started_at DESC, rowid DESC")
        return self._decode(RunRecord, rows[0]["data"], f"run {run_id!r}")

    def list_runs(self) -> list[RunRecord]:
        """All runs, newest first."""
        rows = self._read("SELECT id, data FROM runs ORDER BY started_at DESC, rowid DESC")
        return [self._decode(RunRecord, r["data"], f"run {r['id']!r}") for r in rows]

    # ---- experiments -------------------------------------------------------------

    def save_experiment(self, exp: Experiment) -> None:
        """Insert or replace ``exp`` and rewrite its measurements, findings and artifacts."""
        data = codec.clean(exp.model_dump(mode="json"), self.secrets)
        row = codec.experiment_row(exp, data)
        derived = [
            ("measurements", codec.measurement_rows(exp.run_id, exp.id, data)),
            ("findings", codec.finding_rows(exp.run_id, exp.id, data)),
            ("artifacts", codec.artifact_rows(exp.run_id, exp.id, data)),
        ]
        with self._write(f"save experiment {exp.id!r} of run {exp.run_id!r}") as conn:
            self._require_run(exp.run_id)
            conn.execute(
                "INSERT INTO experiments (run_id, id, seq, parent, status, proposer, probe, tier, wall_s, "
                "accepted, started_at, finished_at, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, id) DO UPDATE SET seq = excluded.seq, "
                "parent = excluded.parent, status = excluded.status, proposer = excluded.proposer, "
                "probe = excluded.probe, tier = excluded.tier, wall_s = excluded.wall_s, "
                "accepted = excluded.accepted, started_at = excluded.started_at, "
                "finished_at = excluded.finished_at, data = excluded.data", row)
            for table, rows in derived:
                conn.execute(f"DELETE FROM {table} WHERE run_id = ? AND exp_id = ?", (exp.run_id, exp.id))
                if rows:
                    marks = ", ".join("?" * len(rows[0]))
                    conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)

    def experiments(self, run_id: str) -> list[Experiment]:
        """The run's experiments, by ``seq``."""
        self._require_run(run_id)
        rows = self._read("SELECT id, data FROM experiments WHERE run_id = ? ORDER BY seq, rowid", (run_id,))
        return [self._decode(Experiment, r["data"], f"experiment {r['id']!r}") for r in rows]

    def _locate(self, exp_id: str, run_id: str | None) -> sqlite3.Row:
        """The experiment's row; ``run_id`` may be left out while the id names one experiment."""
        sql = "SELECT run_id, data FROM experiments WHERE id = ?"
        rows = self._read(sql, (exp_id,)) if run_id is None else self._read(sql + " AND run_id = ?", (exp_id, run_id))
        if len(rows) == 1:
            return rows[0]
        if rows:
            runs = ", ".join(r["run_id"] for r in rows[:_KNOWN_IDS_SHOWN])
            raise LedgerError(f"experiment {exp_id!r} exists in several runs ({runs}) of ledger {self.path}; "
                              f"name the run too")
        scope, params = ("", ()) if run_id is None else (" WHERE run_id = ?", (run_id,))
        raise self._missing("experiment", exp_id if run_id is None else f"{run_id}/{exp_id}",
                            f"SELECT run_id || '/' || id FROM experiments{scope} ORDER BY rowid DESC", params)

    def get_experiment(self, exp_id: str, run_id: str | None = None) -> Experiment:
        return self._decode(Experiment, self._locate(exp_id, run_id)["data"], f"experiment {exp_id!r}")

    def next_seq(self, run_id: str) -> int:
        """One past the run's highest ``seq`` (0 for a run without experiments)."""
        self._require_run(run_id)
        row = self._read("SELECT MAX(seq) FROM experiments WHERE run_id = ?", (run_id,))[0]
        return 0 if row[0] is None else int(row[0]) + 1

    def findings(self, exp_id: str, side: Literal["candidate", "baseline"] | None = "candidate",
                 run_id: str | None = None) -> list[Finding]:
        """The experiment's findings from the findings table (``side=None``: both sides)."""
        run_id = self._locate(exp_id, run_id)["run_id"]
        sql = ("SELECT kind, severity, message, location, evidence, next_question FROM findings "
               "WHERE run_id = ? AND exp_id = ?")
        params: tuple[Any, ...] = (run_id, exp_id)
        if side is not None:
            sql += " AND side = ?"
            params += (side,)
        out = []
        for r in self._read(sql + " ORDER BY side = 'baseline', idx", params):
            raw = {"kind": r["kind"], "severity": r["severity"], "message": r["message"],
                   "location": None if r["location"] is None else json.loads(r["location"]),
                   "evidence": json.loads(r["evidence"]), "next_question": r["next_question"]}
            out.append(self._decode(Finding, raw, f"a finding of experiment {exp_id!r}"))
        return out

    def probe_costs(self) -> dict[tuple[str, str], ProbeCost]:
        """(probe name, tier) -> what it cost over finished experiments of every run.

        A rejected experiment is left out: it stopped before its probe's work (a patch that did
        not apply, a cheap gate that failed before any e2e run), so its 0.1 s would price an
        e2e probe that really takes ~30 s as nearly free.  So is one whose server refused its
        configuration (agent/refused.py): it ends ``done``, but after a launch that failed in
        seconds, with no benchmark run."""
        counted = tuple(sorted(FINISHED - {"rejected"}))
        marks = ", ".join("?" * len(counted))
        rows = self._read(f"SELECT probe, tier, wall_s FROM experiments AS e WHERE probe IS NOT NULL AND tier IS NOT "
                          f"NULL AND status IN ({marks}) AND NOT EXISTS (SELECT 1 FROM findings AS f WHERE "
                          f"f.run_id = e.run_id AND f.exp_id = e.id AND f.side = 'candidate' AND f.kind = ?)",
                          (*counted, FindingKind.SERVER_REFUSED_CONFIG))
        return probe_costs((r["probe"], r["tier"], float(r["wall_s"])) for r in rows)

    # ---- proposer state ----------------------------------------------------------

    def set_state(self, run_id: str, key: str, value: Any) -> None:
        """Store JSON-serialisable ``value`` (scrubbed) under ``key`` for the run."""
        try:
            text = codec.dumps(value, self.secrets)
        except (TypeError, ValueError) as e:
            raise LedgerError(f"state {key!r} of run {run_id!r} is not JSON-serialisable: {e}") from None
        with self._write(f"save state {key!r} of run {run_id!r}") as conn:
            self._require_run(run_id)
            conn.execute("INSERT INTO run_state (run_id, key, value, updated_at) VALUES (?, ?, ?, ?) "
                         "ON CONFLICT (run_id, key) DO UPDATE SET value = excluded.value, "
                         "updated_at = excluded.updated_at", (run_id, key, text, time.time()))

    def get_state(self, run_id: str, key: str, default: Any = None) -> Any:
        rows = self._read("SELECT value FROM run_state WHERE run_id = ? AND key = ?", (run_id, key))
        return json.loads(rows[0]["value"]) if rows else default
