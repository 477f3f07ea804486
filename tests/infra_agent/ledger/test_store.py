"""The Ledger API on real SQLite files: round trips, upserts, costs, state, errors."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import ModuleType

import pytest

from infra_agent.errors import InfraAgentError
from infra_agent.ledger import Ledger, LedgerError, ProbeCost, codec


def _rows(path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql, params).fetchall()


def test_for_workspace_creates_the_file_in_wal_mode(tmp_path: Path) -> None:
    with Ledger.for_workspace(tmp_path) as led:
        assert led.path == tmp_path / ".infra-agent" / "ledger.db"
        assert led.path.is_file()
        assert _rows(led.path, "PRAGMA journal_mode") == [("wal",)]
        assert led._conn is not None
        assert led._conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000


def test_experiments_round_trip(ledger: Ledger, fx: ModuleType) -> None:
    run = fx.make_run()
    ledger.create_run(run)
    saved = [fx.make_experiment(seq=0, with_feedback=False, probe=None),
             fx.make_experiment(seq=1), fx.make_experiment(seq=2, status="running")]
    for exp in reversed(saved):  # order comes from seq, not from insertion
        ledger.save_experiment(exp)
    assert ledger.experiments(run.id) == saved
    assert ledger.get_experiment("run-1-e1") == saved[1]
    assert ledger.get_run(run.id) == run
    # Numbers under "token" keys survive the scrub (they would not validate as "***").
    got = ledger.get_experiment("run-1-e1")
    assert got.cost.llm_tokens == 1234 and got.change.knobs["max_num_batched_tokens"] == 8192
    assert got.feedback is not None and got.feedback.findings[0].evidence["max_tokens"] == 512


def test_derived_rows_follow_the_feedback(ledger: Ledger, fx: ModuleType) -> None:
    ledger.create_run(fx.make_run())
    ledger.save_experiment(fx.make_experiment(seq=1, n_measurements=5))
    count = "SELECT side, COUNT(*) FROM measurements WHERE exp_id = 'run-1-e1' GROUP BY side ORDER BY side"
    assert _rows(ledger.path, count) == [("baseline", 2), ("candidate", 6)]
    # Saving again with different feedback rewrites the rows instead of adding to them.
    ledger.save_experiment(fx.make_experiment(seq=1, n_measurements=2))
    assert _rows(ledger.path, count) == [("baseline", 2), ("candidate", 3)]
    assert len(ledger.experiments("run-1")) == 1
    m0 = _rows(ledger.path, "SELECT name, unit, tags, median, ci_low, ci_high, n, samples FROM measurements "
                            "WHERE exp_id = 'run-1-e1' AND side = 'candidate' ORDER BY idx")
    assert m0[0] == ("m0", "ms", '{"kernel":"k0"}', 3.0, 1.0, 5.0, 5, "[1.0,2.0,3.0,4.0,5.0]")
    assert m0[-1][3:7] == (None, None, None, 0)  # no samples, no summary
    arts = _rows(ledger.path, "SELECT side, kind, path, description FROM artifacts WHERE exp_id = 'run-1-e1' "
                              "ORDER BY side")
    assert arts == [("baseline", "trace", "traces/101.json", "timeline"),
                    ("candidate", "trace", "traces/1.json", "timeline")]
    # Dropping the feedback drops its rows.
    ledger.save_experiment(fx.make_experiment(seq=1, with_feedback=False))
    assert _rows(ledger.path, count) == []
    assert ledger.findings("run-1-e1") == []


def test_findings_come_from_the_findings_table(ledger: Ledger, fx: ModuleType) -> None:
    ledger.create_run(fx.make_run())
    exp = fx.make_experiment(seq=3)
    ledger.save_experiment(exp)
    assert ledger.findings(exp.id) == exp.feedback.findings
    assert ledger.findings(exp.id, side="baseline") == exp.baseline_feedback.findings
    assert ledger.findings(exp.id, side=None) == exp.feedback.findings + exp.baseline_feedback.findings
    assert _rows(ledger.path, "SELECT kind, severity, next_question FROM findings WHERE side = 'candidate' "
                              "ORDER BY idx") == [("slow_kernel", "warning", "why?"), ("note", "info", None)]


def test_experiment_ids_are_per_run(ledger: Ledger, fx: ModuleType) -> None:
    # The loop numbers experiments e0, e1, ... in every run: one run must not overwrite another's.
    for run_id in ("a", "b"):
        ledger.create_run(fx.make_run(run_id))
    ea, eb = fx.make_experiment("a", 0, exp_id="e0"), fx.make_experiment("b", 0, exp_id="e0", n_measurements=1)
    ledger.save_experiment(ea)
    ledger.save_experiment(eb)
    assert ledger.experiments("a") == [ea] and ledger.experiments("b") == [eb]
    assert ledger.get_experiment("e0", run_id="b") == eb
    assert ledger.findings("e0", run_id="a") == ea.feedback.findings
    assert _rows(ledger.path, "SELECT run_id, COUNT(*) FROM measurements GROUP BY run_id") == [("a", 6), ("b", 4)]
    with pytest.raises(LedgerError, match=r"experiment 'e0' exists in several runs \(.*\).*name the run"):
        ledger.get_experiment("e0")
    with pytest.raises(LedgerError, match=r"no experiment 'a/e9'.*known experiments \(newest first\): a/e0$"):
        ledger.get_experiment("e9", run_id="a")
    ledger.save_experiment(fx.make_experiment("a", 1, exp_id="e1"))
    assert ledger.get_experiment("e1").run_id == "a"  # unambiguous without the run


def test_runs_newest_first_and_upsert(ledger: Ledger, fx: ModuleType) -> None:
    for i, t in enumerate([10.0, 30.0, 20.0]):
        ledger.create_run(fx.make_run(f"r{i}", started_at=t))
    assert [r.id for r in ledger.list_runs()] == ["r1", "r2", "r0"]
    done = fx.make_run("r0", started_at=10.0, status="done", finished_at=50.0, best="r0-e3", message="ok")
    ledger.save_run(done)
    assert ledger.get_run("r0") == done
    ledger.save_run(fx.make_run("r9", started_at=5.0))  # save_run also inserts
    assert [r.id for r in ledger.list_runs()][-1] == "r9"


def test_next_seq(ledger: Ledger, fx: ModuleType) -> None:
    ledger.create_run(fx.make_run())
    assert ledger.next_seq("run-1") == 0
    ledger.save_experiment(fx.make_experiment(seq=0))
    ledger.save_experiment(fx.make_experiment(seq=4))
    assert ledger.next_seq("run-1") == 5


def test_probe_costs_learn_from_finished_experiments_of_all_runs(ledger: Ledger, fx: ModuleType) -> None:
    for run_id in ("a", "b"):
        ledger.create_run(fx.make_run(run_id))
    ledger.save_experiment(fx.make_experiment("a", 0, wall_s=1.0))
    ledger.save_experiment(fx.make_experiment("a", 1, wall_s=2.0, status="error"))
    ledger.save_experiment(fx.make_experiment("b", 0, wall_s=6.0, status="timeout"))
    ledger.save_experiment(fx.make_experiment("b", 1, wall_s=100.0, status="running"))  # not finished
    ledger.save_experiment(fx.make_experiment("b", 2, wall_s=0.0, status="rejected"))  # never ran
    ledger.save_experiment(fx.make_experiment("b", 3, wall_s=50.0, probe=None))  # no probe
    ledger.save_experiment(fx.make_experiment("b", 4, wall_s=30.0, probe="serve", tier="e2e"))
    # Rejected after 0.1 s (a cheap gate failed before any e2e run): not what the e2e probe costs.
    ledger.save_experiment(fx.make_experiment("b", 5, wall_s=0.1, probe="serve", tier="e2e", status="rejected"))
    assert ledger.probe_costs() == {("kernel-bench", "micro"): ProbeCost(n=3, mean_s=3.0, median_s=2.0),
                                    ("serve", "e2e"): ProbeCost(n=1, mean_s=30.0, median_s=30.0)}


def test_probe_costs_leave_out_a_configuration_the_server_refused(ledger: Ledger, fx: ModuleType) -> None:
    # A refused configuration ends "done" (refuted), but its server exited at start-up: its
    # 2.5 s launch is not what an e2e benchmark of a configuration that runs costs.
    from infra_agent.agent.executors.base import Refusal
    from infra_agent.agent.planner import Plan
    from infra_agent.agent.refused import record_refusal
    from infra_agent.records import ProbeCall

    ledger.create_run(fx.make_run("a"))
    ledger.save_experiment(fx.make_experiment("a", 1, wall_s=30.0, probe="serving", tier="e2e"))
    refused = fx.make_experiment("a", 2, wall_s=2.5, probe="serving", tier="e2e")
    plan = Plan(probe=ProbeCall(name="serving", tier="e2e"), mode="ab", scenarios=["chat"])
    record_refusal(refused, Refusal(server="refstack", exit_code=2, reason="error: --max-running must be >= 1"), plan,
                   {"max_num_seqs": 64})
    assert refused.status == "done" and refused.verdict is not None and refused.verdict.outcome == "refuted"
    ledger.save_experiment(refused)
    assert ledger.probe_costs() == {("serving", "e2e"): ProbeCost(n=1, mean_s=30.0, median_s=30.0)}
    # A finding of that kind on the parent's side says nothing about the candidate's launch.
    parent_side = fx.make_experiment("a", 3, wall_s=32.0, probe="serving", tier="e2e")
    assert parent_side.baseline_feedback is not None
    parent_side.baseline_feedback.findings = list(refused.feedback.findings) if refused.feedback else []
    ledger.save_experiment(parent_side)
    assert ledger.probe_costs()[("serving", "e2e")] == ProbeCost(n=2, mean_s=31.0, median_s=31.0)


def test_state_is_json_per_run(ledger: Ledger, fx: ModuleType) -> None:
    ledger.create_run(fx.make_run("a"))
    ledger.create_run(fx.make_run("b"))
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"max_tokens": 64}]}]
    ledger.set_state("a", "conversation", conversation)
    ledger.set_state("a", "trials", {"params": [{"max_num_batched_tokens": 4096}], "values": [1.5, None]})
    ledger.set_state("a", "trials", {"params": [], "values": []})  # overwrite
    assert ledger.get_state("a", "conversation") == conversation
    assert ledger.get_state("a", "trials") == {"params": [], "values": []}
    assert ledger.get_state("b", "conversation", default=[]) == []
    assert ledger.get_state("a", "missing") is None
    with pytest.raises(LedgerError, match="not JSON-serialisable"):
        ledger.set_state("a", "bad", object())
    with pytest.raises(LedgerError, match="no run 'nope'"):
        ledger.set_state("nope", "k", 1)


def test_missing_ids_are_named_with_known_ones(ledger: Ledger, fx: ModuleType) -> None:
    with pytest.raises(LedgerError, match="no run 'x'.*has no runs"):
        ledger.get_run("x")
    for i in range(12):
        ledger.create_run(fx.make_run(f"r{i:02d}", started_at=float(i)))
    with pytest.raises(LedgerError) as err:
        ledger.get_run("r99")
    msg = str(err.value)
    assert isinstance(err.value, InfraAgentError)
    assert "'r99'" in msg and str(ledger.path) in msg and "r11, r10" in msg and "r02, ..." in msg
    assert "r01" not in msg
    with pytest.raises(LedgerError, match="no experiment 'e-404'"):
        ledger.get_experiment("e-404")
    with pytest.raises(LedgerError, match="no experiment 'e-404'"):
        ledger.findings("e-404")
    with pytest.raises(LedgerError, match="no run 'ghost'"):
        ledger.save_experiment(fx.make_experiment("ghost", 0))
    with pytest.raises(LedgerError, match="no run 'ghost'"):
        ledger.experiments("ghost")
    with pytest.raises(LedgerError, match="run 'r01' already exists"):
        ledger.create_run(fx.make_run("r01"))


def test_a_failed_save_leaves_nothing_behind(ledger: Ledger, fx: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger.create_run(fx.make_run())
    exp = fx.make_experiment(seq=1)
    ledger.save_experiment(exp)
    orig = codec.measurement_rows

    def dup_rows(run_id: str, exp_id: str, data: dict[str, object]) -> list[tuple[object, ...]]:
        # A repeated (run_id, exp_id, side, idx) breaks the primary key after the experiment
        # row and the deletes already ran: the transaction must undo all of them.
        rows = orig(run_id, exp_id, data)
        return rows + rows[:1]

    monkeypatch.setattr(codec, "measurement_rows", dup_rows)
    with pytest.raises(LedgerError, match="failed to save experiment 'run-1-e1' of run 'run-1'"):
        ledger.save_experiment(fx.make_experiment(seq=1, n_measurements=7, status="error"))
    monkeypatch.undo()
    assert ledger.get_experiment(exp.id) == exp
    assert _rows(ledger.path, "SELECT COUNT(*) FROM measurements WHERE side = 'candidate'") == [(4,)]


def test_closed_ledger_says_so(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.db")
    led.close()
    led.close()  # idempotent
    with pytest.raises(LedgerError, match="is closed"):
        led.list_runs()


def test_launches_round_trip_and_a_row_from_before_them_reads_zero(ledger: Ledger, fx: ModuleType) -> None:
    run = fx.make_run()
    ledger.create_run(run)
    refused = fx.make_experiment(seq=1)
    refused.cost = refused.cost.model_copy(update={"launches": 2, "e2e_runs": 0})
    old = fx.make_experiment(seq=2)
    for exp in (refused, old):
        ledger.save_experiment(exp)
    assert ledger.get_experiment(refused.id).cost == refused.cost
    # A row written before launches were counted has no such key in its JSON.
    with sqlite3.connect(ledger.path) as conn:
        conn.execute("UPDATE experiments SET data = json_remove(data, '$.cost.launches') WHERE id = ?", (old.id,))
    assert "launches" not in _rows(ledger.path, "SELECT json_extract(data, '$.cost') FROM experiments WHERE id = ?",
                                   (old.id,))[0][0]
    got = ledger.get_experiment(old.id)
    assert got.cost.launches == 0 and got.cost.probe_runs == old.cost.probe_runs
    assert got.cost.runs_text() == "0 e2e runs" and refused.cost.runs_text() == "0 e2e runs, 2 launches"
