"""API keys and extra headers against a server that requires them; the key never leaks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.errors import ConfigError
from infra_agent.serving.runner import run_workspace_scenario
from infra_agent.workspace import load_workspace

runner = CliRunner()
KEY = "sk-test-9f8e7d6c5b4a39281706"
LOAD = ["--num-requests", "6", "--max-concurrency", "2", "--input-len", "8", "--output-len", "4", "--no-progress"]


@pytest.fixture
def keyed_server(fake_server_factory, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A server that answers /v1 only with ``Authorization: Bearer KEY`` and ``X-Team: infra``, as vLLM --api-key does."""
    monkeypatch.setenv("BENCH_TEST_KEY", KEY)
    return fake_server_factory("--api-key-env", "BENCH_TEST_KEY", "--require-header", "X-Team: infra")


def _no_key(*texts: str) -> None:
    for text in texts:
        assert KEY not in text


def test_url_mode_sends_the_key_and_never_writes_it(keyed_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", keyed_server.url, *LOAD, "--api-key-env", "BENCH_TEST_KEY", "--header", "X-Team: infra",
                              "--metrics-url", keyed_server.metrics_url, "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["model_id"] == "fake-model"  # /v1/models needed the key too
    assert data["api_key_env"] == "BENCH_TEST_KEY" and data["request_headers"] == ["Authorization", "X-Team"]
    _no_key(res.output, out.read_text(), (tmp_path / "r.requests.jsonl").read_text())
    as_json = runner.invoke(app, ["bench", keyed_server.url, *LOAD, "--api-key-env", "BENCH_TEST_KEY", "--header", "X-Team: infra", "--json"])
    assert as_json.exit_code == 0, as_json.output
    _no_key(as_json.output)


def test_missing_or_wrong_key_is_a_clear_user_error(keyed_server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    res = runner.invoke(app, ["bench", keyed_server.url, *LOAD, "--header", "X-Team: infra"])
    assert res.exit_code == 2
    assert "HTTP 401" in res.output and "--api-key-env" in res.output
    res = runner.invoke(app, ["bench", keyed_server.url, *LOAD, "--api-key-env", "NOT_SET_ANYWHERE_42"])
    assert res.exit_code == 2 and "NOT_SET_ANYWHERE_42" in res.output
    monkeypatch.setenv("WRONG_KEY", "sk-wrong-0123456789")
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", keyed_server.url, *LOAD, "--api-key-env", "WRONG_KEY", "--header", "X-Team: infra", "-o", str(out)])
    assert res.exit_code == 2 and "HTTP 401" in res.output
    assert "sk-wrong-0123456789" not in res.output + out.read_text()
    res = runner.invoke(app, ["bench", keyed_server.url, *LOAD, "--header", "no colon here"])
    assert res.exit_code == 2 and "'Name: value'" in res.output and "no colon here" not in res.output


def test_endpoint_workspace_with_api_key_env_and_headers(keyed_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "infra-agent.yaml").write_text(
        f"target: {{kind: endpoint, url: '{keyed_server.url}', metrics_url: /metrics, api_key_env: BENCH_TEST_KEY,"
        " headers: {X-Team: infra}}\n"
        "scenarios:\n  s: {dataset: {kind: random, input_len: 8, output_len: 4}, num_requests: 4}\n"
    )
    ws = load_workspace(ws_dir)
    out = tmp_path / "r.json"
    result = run_workspace_scenario(ws, progress=False, output=out)
    assert result["ok"] and result["completed"] == 4 and result["api_key_env"] == "BENCH_TEST_KEY"
    assert result["server_metrics"]["e2e"]["count"] == 4
    _no_key(out.read_text(), (ws_dir / "infra-agent.yaml").read_text())
    res = runner.invoke(app, ["bench", str(ws_dir), "--api-key-env", "X", "--no-progress"])
    assert res.exit_code == 2 and "--api-key-env" in res.output  # the workspace owns its auth


def test_server_workspace_with_a_key_launches_and_authenticates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM started with --api-key: the launched server and the client read the same variable.
    monkeypatch.setenv("LAUNCH_KEY", KEY)
    server = Path(__file__).with_name("fake_openai_server.py")
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "infra-agent.yaml").write_text(
        "target:\n  kind: server\n"
        f"  command: {json.dumps([sys.executable, str(server), '--port', '{port}', '--api-key-env', 'LAUNCH_KEY'])}\n"
        "  ready_url: /v1/models\n  api_key_env: LAUNCH_KEY\n  ready_timeout_s: 30\n"
        "scenarios:\n  s: {dataset: {kind: random, input_len: 8, output_len: 4}, num_requests: 4}\n"
    )
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["bench", str(ws_dir), "--no-progress", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["completed"] == 4
    _no_key(res.output, out.read_text(), *(p.read_text() for p in (ws_dir / ".infra-agent" / "logs").glob("*.log")))


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("{kind: endpoint, url: 'http://127.0.0.1:1', api_key_env: 'sk-live-abc123'}", "target.api_key_env"),
        ("{kind: endpoint, url: 'http://127.0.0.1:1', headers: {Authorization: 'Bearer sk-live-abc123'}}", "api_key_env"),
        ("{kind: server, command: x, headers: {'bad name': v}}", "target.headers"),
    ],
)
def test_keys_in_the_file_are_refused(tmp_path: Path, target: str, message: str) -> None:
    (tmp_path / "infra-agent.yaml").write_text(f"target: {target}\n")
    with pytest.raises(ConfigError) as info:
        load_workspace(tmp_path)
    assert message in str(info.value) and "sk-live-abc123" not in str(info.value)
