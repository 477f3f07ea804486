"""A server that crashes mid-run: the result is still written, with what the run measured.

Also the per-request JSONL beside it, the failed-fraction limit, a run killed with
SIGKILL (its server goes, its JSONL stays), and the user errors that must exit 2.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.target import find_owned_groups, group_members
from infra_agent.target.procgroup import OWNER_TOKEN_ENV

runner = CliRunner()
LOAD = ["--num-requests", "60", "--max-concurrency", "4", "--input-len", "8", "--output-len", "4", "--no-progress"]


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def _jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_url_crash_with_metrics_url_still_writes_the_result(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # 1 check request + 59 answered, then the server exits: /metrics is gone after the window.
    srv = fake_server_factory("--mode", "die-after", "--die-after", "20")
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", srv.url, *LOAD, "--metrics-url", srv.metrics_url, "-o", str(out)])
    assert res.exit_code == 1, res.output
    data = json.loads(out.read_text())
    assert data["ok"] is False and "metrics could not be scraped after the window" in data["error"]
    # The server dies with requests in flight: a few of the 19 it took never finish.
    assert 12 <= data["completed"] <= 19 and data["completed"] + data["failed"] == 60 and data["server_metrics"] is None
    assert len(data["ttfts"]) == 60  # the per-request lists survive
    lines = _jsonl(tmp_path / "r.requests.jsonl")
    assert data["requests_file"] == str(tmp_path / "r.requests.jsonl")
    assert sorted(x["index"] for x in lines) == list(range(60))
    assert sum(x["success"] for x in lines) == data["completed"]
    ok_line = next(x for x in lines if x["success"])
    assert ok_line["output_len"] == 4 and len(ok_line["itl"]) == 3 and ok_line["ttft"] > 0 and ok_line["start"] >= 0
    assert "run failed" in res.output and "result written to" in res.output


def test_url_crash_without_metrics_fails_by_the_failed_fraction(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = fake_server_factory("--mode", "die-after", "--die-after", "20")
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", srv.url, *LOAD, "-o", str(out)])
    assert res.exit_code == 1, res.output
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["max_failed_fraction"] == 0
    failed = data["failed"]
    assert failed >= 41
    assert data["error"].startswith(f"{failed} of 60 requests failed ({failed / 60:.1%}), more than the 0 allowed (--max-failed-fraction)")
    assert f"{failed} of 60 requests failed" in res.output


def test_failed_fraction_limit(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Greedy "empty" answers fail every request without a crash; a limit of 1 accepts them.
    srv = fake_server_factory("--mode", "empty")
    res = runner.invoke(app, ["bench", srv.url, *LOAD, "--max-failed-fraction", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["failed"] == 60
    bad = runner.invoke(app, ["bench", srv.url, *LOAD, "--max-failed-fraction", "1.5"])
    assert bad.exit_code == 2 and "--max-failed-fraction" in bad.output


def test_workspace_crash_keeps_the_requests_and_prints_the_log_tail_once(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = fake_workspace("--mode die-after --die-after 20", num_requests=60)
    out = tmp_path / "ws.json"
    res = runner.invoke(app, ["bench", str(ws), "--no-progress", "-o", str(out)])
    assert res.exit_code == 1, res.output
    data = json.loads(out.read_text())
    assert data["ok"] is False and data["error"].startswith("server died during the run: server exited while running (exit code 3)")
    assert "--- log tail ---" not in data["error"]
    assert data["completed"] >= 15 and data["completed"] + data["failed"] == 60 and len(data["e2els"]) == 60
    assert "simulated crash after 20 requests" in data["log_tail"]
    assert sum(x["success"] for x in _jsonl(tmp_path / "ws.requests.jsonl")) == data["completed"]
    assert res.output.count("simulated crash after 20 requests") == 1
    assert "completed / failed" in res.output  # the table of what was measured


def test_sigkilled_bench_client_stops_its_server_and_keeps_its_requests(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = fake_workspace(num_requests=400)
    token = f"bench-kill-{os.getpid()}"
    out = tmp_path / "killed.json"
    client = subprocess.Popen(
        [sys.executable, "-m", "infra_agent.cli.main", "bench", str(ws), "--set", "token_delay_ms=40", "-o", str(out)],
        env={**os.environ, OWNER_TOKEN_ENV: token}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    requests = tmp_path / "killed.requests.jsonl"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (requests.exists() and len(requests.read_text().splitlines()) >= 8):
            time.sleep(0.1)
        groups = find_owned_groups(token)
        assert len(groups) == 1, groups  # the server it launched, found by its mark
        client.send_signal(signal.SIGKILL)
        assert client.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while group_members(groups[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_members(groups[0]) == [] and find_owned_groups(token) == []
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        for pgid in find_owned_groups(token):
            os.killpg(pgid, signal.SIGKILL)
    assert not out.exists()  # the run never ended ...
    kept = _jsonl(requests)  # ... but what it measured is on disk
    assert len(kept) >= 8 and all(x["success"] for x in kept)


def test_url_with_another_scheme_is_a_clear_error() -> None:
    res = runner.invoke(app, ["bench", "ftp://x", "--no-progress"])
    assert res.exit_code == 2
    assert "'ftp://' is not supported" in _flat(res.output) and "ftp:/x" not in res.output.replace("ftp://x", "")


def test_fixed_port_already_in_use_is_a_user_error(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    squatter = fake_server_factory()
    port = int(squatter.url.rsplit(":", 1)[1])
    server = Path(__file__).with_name("fake_openai_server.py")
    ws = tmp_path / "ws"
    ws.mkdir()

    def write(ready_url: str) -> None:
        (ws / "infra-agent.yaml").write_text(
            "target:\n  kind: server\n"
            f"  command: {json.dumps([sys.executable, str(server), '--port', str(port)])}\n"
            f"  ready_url: {ready_url}\n  ready_timeout_s: 30\n"
            "scenarios:\n  s: {dataset: {kind: random, input_len: 8, output_len: 4}, num_requests: 4}\n"
        )

    # The ready URL names the taken port: readiness would come from the other server,
    # and ours would die on its bind mid-run (this used to exit 1 as a crash).
    write(f"http://127.0.0.1:{port}/v1/models")
    res = runner.invoke(app, ["bench", str(ws), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert f"port {port} is already in use" in _flat(res.output)
    # The ready URL on the port we chose: the server fails its bind; no retry on another
    # port can help a command with a fixed one.
    write("/v1/models")
    res = runner.invoke(app, ["bench", str(ws), "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "could not bind its port" in _flat(res.output) and "put {port} in the command" in _flat(res.output)
    assert len(list((ws / ".infra-agent" / "logs").glob("*.log"))) == 1


def test_unreachable_url_with_output_still_writes_a_failed_result(tmp_path: Path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", f"http://127.0.0.1:{port}", "--num-requests", "2", "--no-progress", "-o", str(out)])
    assert res.exit_code == 2
    data = json.loads(out.read_text())
    assert data["ok"] is False and "cannot reach" in data["error"]


def test_a_dead_server_stops_the_window_at_a_run_of_refusals(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # 2 000 requests at once, the server exits after 20: the window stops at the first
    # refusals in a row instead of "sending" the rest to nobody.
    srv = fake_server_factory("--mode", "die-after", "--die-after", "20")
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", srv.url, "--num-requests", "2000", "--max-concurrency", "4", "--input-len", "8",
                              "--output-len", "4", "--no-progress", "-o", str(out)])
    assert res.exit_code == 1, res.output
    data = json.loads(out.read_text())
    assert data["ok"] is False and "the server stopped accepting connections" in data["stopped"]
    assert "refusals in a row" in data["error"] and "the server stopped accepting connections" in _flat(res.output)
    # What reached the socket: the ~20 answered, those in flight when it died and the
    # refusals that stopped the window; every other request is recorded as not answered.
    lines = _jsonl(tmp_path / "r.requests.jsonl")
    assert sorted(x["index"] for x in lines) == list(range(2000))
    tried = [x for x in lines if not (x["error"] or "").startswith("stopped before an answer: the server stopped")]
    assert len(tried) < 200, len(tried)
    assert data["completed"] + data["failed"] == 2000 and len(data["ttfts"]) == 2000
