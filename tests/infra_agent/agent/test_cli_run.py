"""`run`, `resume`, `ls`, `report`, `standin` and `demo` on bad input and faults.

A user mistake exits 2 with one message naming what was wrong, before any server
starts and without leaving a run in the ledger; `--json` keeps stdout one JSON object.
Only the last test starts servers: Ctrl-C during a run, then `ls` and `resume`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from infra_agent.agent.runner import _start_time
from infra_agent.cli.main import app
from infra_agent.ledger import Ledger
from infra_agent.records import RunRecord


def _workspace(root: Path, command: list[str] | str | None = None, requests: int = 8) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    spec = {
        "name": "cli-test",
        "target": {"kind": "server", "ready_url": "/health", "ready_timeout_s": 120,
                   "command": command or [sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny", "--host",
                                          "127.0.0.1", "--log-level", "warning", "--port", "{port}",
                                          "--max-running", "{max_running}"]},
        "knobs": {"max_running": {"type": "int", "min": 1, "max": 64, "default": 4, "components": ["engine.scheduler"]}},
        "scenarios": {"chat": {"dataset": {"kind": "random", "input_len": 16, "output_len": 8, "seed": 0},
                               "endpoint": "chat", "num_requests": requests, "max_concurrency": 4, "warmup_requests": 1}},
        "criteria": [{"name": "tput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 1.0e9}],
    }
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root


def _cli(*args: str) -> tuple[int, Any, str]:
    """(exit status, stdout parsed as JSON, stderr) of one in-process CLI call with --json."""
    result = CliRunner().invoke(app, [*args, "--json"])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.stderr
    return result.exit_code, json.loads(result.stdout), result.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return _workspace(tmp_path / "ws")


def _playbook(tmp_path: Path, text: str) -> str:
    path = tmp_path / "playbook.yaml"
    path.write_text(text)
    return str(path)


UNKNOWN_KIND = """rules:
  - name: x
    when: {kind: no_such_kind}
    change: {knob: [max_running], set: 8}
    hypothesis: {statement: s, metric: output_throughput, direction: higher}
"""


@pytest.mark.parametrize("args, says", [
    (["--proposer", "foo"], "--proposer: expected 'rules', 'search' or 'llm', got 'foo'"),
    (["--proposer", "llm"], "missing: --model, --base-url"),
    (["--proposer", "llm", "--model", "m", "--base-url", "localhost:8000"], "--base-url: expected an http:// or https:// URL"),
    (["--model", "m"], "--model: expected --proposer llm"),
    (["--pairs", "2"], "--pairs: expected greater than or equal to 3, got 2"),
    (["--budget-runs", "0"], "--budget-runs: expected greater than or equal to 1, got 0"),
    (["--scenario", "nosuch"], "--scenario: expected one of the scenarios of"),
    (["--playbook", "{tmp}/none.yaml"], "none.yaml: expected a playbook file (YAML; --playbook), got 'no such file'"),
    (["--playbook", "PLAYBOOK:rules: [\n  - x\n"], "playbook.yaml:2:3: expected valid YAML"),
    (["--playbook", "PLAYBOOK:- a rule\n"], "playbook.yaml: expected a mapping with `rules:`"),
    (["--playbook", "PLAYBOOK:" + UNKNOWN_KIND], "playbook.yaml:3:18: rules.0.when.kind: expected a finding kind"),
])
def test_run_mistakes_exit_2_before_anything_runs(ws: Path, tmp_path: Path, args: list[str], says: str) -> None:
    args = [_playbook(tmp_path, a.removeprefix("PLAYBOOK:")) if a.startswith("PLAYBOOK:") else a.replace("{tmp}", str(tmp_path))
            for a in args]
    code, out, err = _cli("run", str(ws), *args)
    assert code == 2 and set(out) == {"error", "message"}
    assert says in out["message"], out["message"]
    assert " ".join(out["message"].split()) in " ".join(err.split())  # the same one message on stderr (wrapped)
    assert not (ws / ".infra-agent").exists()  # no run left "running" in a ledger


def test_run_checks_the_target_command_and_the_llm_endpoint_first(tmp_path: Path) -> None:
    missing = _workspace(tmp_path / "missing", command="no-such-server-xyz --port {port}")
    code, out, _ = _cli("run", str(missing))
    assert code == 2 and "infra-agent.yaml: target.command: expected a program found on PATH" in out["message"]
    assert "'no-such-server-xyz'" in out["message"]
    ws = _workspace(tmp_path / "ws")
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    code, out, _ = _cli("run", str(ws), "--proposer", "llm", "--model", "m", "--base-url", url)
    assert code == 2 and out["message"].startswith(f"cannot reach the LLM endpoint at {url} (--base-url)")
    code, out, _ = _cli("run", str(tmp_path / "nowhere"))
    assert code == 2 and "infra-agent.yaml" in out["message"]
    assert not any(p.name == ".infra-agent" for p in tmp_path.rglob("*"))


def test_no_ledger_is_no_runs_and_none_is_created(ws: Path) -> None:
    assert _cli("ls", str(ws))[:2] == (0, [])
    human = CliRunner().invoke(app, ["ls", str(ws)])
    assert human.exit_code == 0 and "no runs in" in human.stdout
    for verb in ("resume", "report"):
        code, out, _ = _cli(verb, "r1", "-w", str(ws))
        assert code == 2 and "has no ledger" in out["message"] and "infra-agent run" in out["message"]
    assert not (ws / ".infra-agent").exists()


def _record(ledger: Ledger, ws: Path, run_id: str, status: str) -> None:
    ledger.create_run(RunRecord(id=run_id, workspace=str(ws), proposer="rules", status=status, started_at=time.time(),  # type: ignore[arg-type]
                                message="every gate passes" if status == "done" else "", options={"pairs": 3}))


def test_resume_refuses_unknown_finished_and_live_runs(ws: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with Ledger.for_workspace(ws) as ledger:
            _record(ledger, ws, "r-done", "done")
            _record(ledger, ws, "r-live", "running")
            ledger.set_state("r-live", "owner", {"pid": sleeper.pid, "host": socket.gethostname(),
                                                 "start": _start_time(sleeper.pid)})
        code, out, _ = _cli("resume", "nosuch", "-w", str(ws))
        assert code == 2 and "no run 'nosuch'" in out["message"] and "r-done" in out["message"]
        code, out, _ = _cli("report", "nosuch", "-w", str(ws))
        assert code == 2 and "no run 'nosuch'" in out["message"]
        code, out, _ = _cli("resume", "r-done", "-w", str(ws))
        assert code == 2 and "is finished (done: every gate passes)" in out["message"]
        code, out, _ = _cli("resume", "r-live", "-w", str(ws))
        assert code == 2 and f"still running in process {sleeper.pid}" in out["message"]
    finally:
        sleeper.kill()
        sleeper.wait()
    code, rows, _ = _cli("ls", str(ws))
    assert code == 0 and {r["id"]: r["status"] for r in rows} == {"r-done": "done", "r-live": "running"}


@pytest.mark.parametrize("text, says", [
    ("turns: [\n", "script.yaml: expected valid YAML or JSON, got \"line 2, column 1: while parsing"),
    ("", "expected a list of turns, or a mapping with `turns:` (a list) and options, got 'an empty file'"),
    ("turns:\n  - {tool_calls: [{tool: x, argumentz: {}}]}\n",
     "turns.0.tool_calls.0.argumentz: expected one of the keys tool, arguments, arguments_text, got 'argumentz'"),
    ("turns:\n  - {text: a, tool_calls: [{tool: x}]}\n", "turns.0: expected a turn with exactly one of"),
])
def test_standin_bad_scripts(tmp_path: Path, text: str, says: str) -> None:
    script = tmp_path / "script.yaml"
    script.write_text(text)
    code, out, _ = _cli("standin", "--script", str(script))
    assert code == 2 and says in out["message"], out["message"]
    code, out, _ = _cli("standin", "--script", str(script), "--port", "70000")
    assert code == 2 and "--port: expected a port from 0 to 65535" in out["message"]


def test_demo_refuses_a_folder_it_did_not_make(tmp_path: Path) -> None:
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, out, _ = _cli("demo", "--workdir", str(mine))
    assert code == 2 and "--workdir: expected a new or empty folder" in out["message"]
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    code, out, _ = _cli("demo", "--workdir", str(mine / "notes.txt"))
    assert code == 2 and "is a file" in out["message"]
    assert _cli("demo", "--pairs", "2")[0] == 2


def _status(db: Path, what: str) -> str | None:
    if not db.exists():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        row = con.execute(f"SELECT {what}").fetchone()
    except sqlite3.OperationalError:
        return None
    finally:
        con.close()
    return row[0] if row else None


def _leftovers(run_id: str) -> list[str]:
    """Processes of the run still alive: its workers and servers (marked in their environment)."""
    from infra_agent.agent.executors.cleanup import marked_pids

    return [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ") for p in marked_pids(f"{run_id}/")]


@pytest.mark.slow
def test_ctrl_c_then_ls_then_resume(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    db = ws / ".infra-agent" / "ledger.db"
    cmd = [sys.executable, "-m", "infra_agent.cli.main"]
    proc = subprocess.Popen([*cmd, "run", str(ws), "--budget-runs", "1", "--no-confirm", "--no-report", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # SIGINT at its default, as in a terminal (a background job may inherit it ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    deadline = time.monotonic() + 120
    while _status(db, "id FROM experiments WHERE status = 'running'") is None and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(1.0)  # the baseline's server is starting or serving
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    data = json.loads(out)
    run_id = data["run"]["id"]
    assert data["error"] == "Interrupted" and data["run"]["status"] == "interrupted"
    assert f"resume with `infra-agent resume {run_id} -w {ws}`" in err
    assert _leftovers(run_id) == []
    assert not (ws / ".infra-agent" / "worktrees" / run_id).exists()

    code, rows, _ = _cli("ls", str(ws))
    assert code == 0 and [(r["id"], r["status"]) for r in rows] == [(run_id, "interrupted")]

    done = subprocess.run([*cmd, "resume", run_id, "-w", str(ws), "--json", "--no-report"], capture_output=True, text=True,
                          timeout=300, check=False)
    record = json.loads(done.stdout)
    assert record["status"] in ("done", "budget") and record["gates_before"]
    # 0 only when every gate of the final table passes; 3 when the run ended with one that does not.
    failing = [g for g in record["gates_after"] if g["outcome"] not in ("pass", "skipped")]
    assert done.returncode == (3 if failing else 0), (done.returncode, done.stderr[-3000:])
    assert _leftovers(run_id) == []
    code, out, _ = _cli("resume", run_id, "-w", str(ws))
    assert code == 2 and "is finished" in out["message"]
