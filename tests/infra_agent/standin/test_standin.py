"""The stand-in chat server over real HTTP: scripted turns, faults, recorded requests, the CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra_agent.errors import ConfigError
from infra_agent.standin.script import load_script, parse_script
from infra_agent.standin.server import received_requests, serve_standin

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("read_file", "finish")]


def chat(url: str, messages: list | None = None, key: str = "k", **extra: object) -> httpx.Response:
    body = {"model": "any", "messages": messages or [{"role": "user", "content": "hello"}], "tools": TOOLS, **extra}
    return httpx.post(url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10,
                      trust_env=False)


def test_turns_are_answered_in_order_with_usage(tmp_path: Path) -> None:
    script = tmp_path / "plan.yaml"
    script.write_text("model: scripted\nturns:\n"
                      "  - tool_calls:\n"
                      "      - {tool: read_file, arguments: {path: src/engine.py}}\n"
                      "      - {tool: read_file, arguments_text: '{\"path\": '}\n"
                      "  - text: plain words\n")
    with serve_standin(script) as url:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        models = httpx.get(url + "/models", trust_env=False).json()
        assert models["data"][0]["id"] == "scripted"
        first = chat(url).json()
        msg = first["choices"][0]["message"]
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"path": "src/engine.py"}', '{"path": ']
        assert msg["tool_calls"][0]["id"] != msg["tool_calls"][1]["id"]
        usage = first["usage"]
        assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        second = chat(url).json()["choices"][0]
        assert second["message"]["content"] == "plain words" and second["finish_reason"] == "stop"
        # Past the last turn: a finish call (the request offers the tool).
        third = chat(url).json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert third["name"] == "finish" and "no more turns" in third["arguments"]
        seen = received_requests(url)
    assert [r["turn"] for r in seen] == [0, 1, None]
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}] and seen[0]["tools"] == ["read_file", "finish"]
    assert all(r["authorization"] == "present" and r["status"] == 200 for r in seen)


def test_faults_key_and_stream(tmp_path: Path) -> None:
    script = {"require_key": "right-key", "fail": {"status": 500, "times": 1},
              "turns": [{"text": "a", "fail": {"status": 429, "times": 2}}, {"text": "b"}]}
    with serve_standin(script) as url:
        assert chat(url, key="wrong").status_code == 401
        assert "invalid API key" in chat(url, key="wrong").json()["error"]["message"]
        assert chat(url, key="right-key", stream=True).status_code == 400
        statuses = [chat(url, key="right-key").status_code for _ in range(4)]
        assert statuses == [500, 429, 429, 200]
        assert chat(url, key="right-key").json()["choices"][0]["message"]["content"] == "b"
        bad = httpx.post(url + "/chat/completions", content=b"not json", trust_env=False)
        assert bad.status_code == 400


def test_delay_and_conditional_turns() -> None:
    script = [{"text": "slow", "delay_s": 0.3},
              {"text": "only after a pass", "when_tool_result_contains": "PASS"},
              {"text": "fallback"}]
    with serve_standin(script) as url:
        t0 = time.monotonic()
        assert chat(url).json()["choices"][0]["message"]["content"] == "slow"
        assert time.monotonic() - t0 >= 0.3
        failed = [{"role": "assistant", "content": None}, {"role": "tool", "tool_call_id": "c", "content": "FAIL"}]
        assert chat(url, failed).json()["choices"][0]["message"]["content"] == "fallback"


def test_script_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"turns.0: expected a turn with exactly one of `tool_calls` or `text`"):
        parse_script([{"delay_s": 1}])
    with pytest.raises(ConfigError, match=r"turns.0.fail.status: expected greater than or equal to 400, got 200"):
        parse_script([{"text": "x", "fail": {"status": 200}}])
    with pytest.raises(ConfigError, match=r"turns.0.tool_calls.0.tool: expected a value"):
        parse_script([{"tool_calls": [{"arguments": {}}]}])
    bad = tmp_path / "bad.yaml"
    bad.write_text("turns: [text: x\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: expected valid YAML or JSON"):
        load_script(bad)


def test_cli_serves_a_script_file(tmp_path: Path) -> None:
    script = tmp_path / "plan.json"
    script.write_text('[{"text": "from the cli"}]')
    proc = subprocess.Popen([sys.executable, "-m", "infra_agent.standin.server", "--script", str(script), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "not a model" in line, line
        base = line.split(" on ", 1)[1].split(": ", 1)[0]
        assert chat(base).json()["choices"][0]["message"]["content"] == "from the cli"
    finally:
        proc.terminate()
        proc.wait(10)


def test_cli_reports_a_bad_script(tmp_path: Path) -> None:
    from infra_agent.standin.server import main

    assert main(["--script", str(tmp_path / "missing.yaml")]) == 2
