from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from infra_agent.cli.main import app

runner = CliRunner()


def test_bench_url_writes_result_json_and_prints_table(fake_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "result.json"
    res = runner.invoke(app, ["bench", fake_server.url, "--num-requests", "8", "--max-concurrency", "2", "--input-len", "16",
                              "--output-len", "4", "--metrics-url", fake_server.metrics_url, "--percentiles", "50,90,99",
                              "--output", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["completed"] == 8 and data["total_output_tokens"] == 32
    assert "p90_ttft_ms" in data and "p99_itl_ms" in data
    assert "output throughput" in res.output and "TTFT [ms]" in res.output and "server e2e" in res.output


def test_bench_json_and_clean_error_for_unreachable(tmp_path: Path) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    res = runner.invoke(app, ["bench", f"http://127.0.0.1:{port}", "--num-requests", "2", "--json", "--no-progress"])
    assert res.exit_code == 2
    assert json.loads(res.stdout)["error"] == "TargetError"
    assert "Traceback" not in res.output


def test_bench_workspace_mode_with_set(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = fake_workspace(num_requests=6)
    out = tmp_path / "ws.json"
    res = runner.invoke(app, ["bench", str(ws), "--set", "token_delay_ms=3", "--num-requests", "4", "--json", "--no-progress",
                              "--output", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["completed"] == 4 and data["knobs"] == {"token_delay_ms": 3.0} and data["scenario"] == "small"
    assert json.loads(out.read_text())["completed"] == 4
    bad = runner.invoke(app, ["bench", str(ws), "--set", "nope=1", "--no-progress"])
    assert bad.exit_code == 2 and "nope" in bad.output


def test_workspace_mode_rejects_url_only_flags(fake_workspace) -> None:  # type: ignore[no-untyped-def]
    # The scenario and the target own the dataset and the model in workspace mode;
    # a flag that would be ignored is refused, naming the flag.
    ws = fake_workspace(num_requests=2)
    res = runner.invoke(app, ["bench", str(ws), "--input-len", "999", "--model", "m", "--no-progress"])
    assert res.exit_code == 2
    assert "--input-len" in res.output and "--model" in res.output and "Traceback" not in res.output
