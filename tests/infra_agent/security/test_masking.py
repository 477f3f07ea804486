"""Masking by value (``infra_agent.safety``): the secrets go, names of metrics and code stay.

Issue #37 item 3 and #38: masking keyed on words such as "token" and "key" in text
turned ``per_token_ms``, ``key=lambda x: x`` and ``token_ids`` into ``***`` (source read
by ``read_file`` included), while a password inside a URL and a ``--api-key`` in a
launch command came through.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from rich.table import Table

from infra_agent.safety import (
    MASK,
    command_secrets,
    env_secrets,
    mask_values,
    scrub,
    scrub_text,
    secret_name,
    target_secrets,
)
from infra_agent.tools import ToolContext, default_registry
from infra_agent.workspace import parse_workspace

CODE = '''\
def step(batch, per_token_ms: float = 0.25, max_batch_tokens: int = 8192):
    token_ids = tokenizer.encode(prompt)
    batch.sort(key=lambda x: x.arrival)
    api_key: Optional[str] = None
    authorization: str | None = None
    return {"per_token_ms": per_token_ms, "max_tokens": 64}
'''
METRICS = "vllm:time_to_first_token_seconds 0.12\nper_token_ms=3.5 max_batch_tokens: 64 llm_tokens=1234\n"


@pytest.fixture(autouse=True)
def _no_secrets_of_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # The machine's own secret-named variables would be masked too; the tests set theirs.
    for name in list(os.environ):
        if secret_name(name):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("text", [CODE, METRICS, "xs.sort(key=lambda x: x)", "token_ids = [1, 2, 3]",
                                  "per_token_ms", "max_batch_tokens: 64", "api_key_env: OPENAI_API_KEY",
                                  "Bearer authentication is used", "http://127.0.0.1:8000/v1"])
def test_names_of_code_and_metrics_come_through(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-FAKE0123456789")
    assert scrub_text(text) == text


def test_structured_masking_keeps_numbers_and_names() -> None:
    data = {"per_token_ms": 0.25, "max_tokens": 64, "token_ids": [1, 2], "llm_tokens": 1234, "auth_retries": 3,
            "key": "engine.step/attention", "token": " world", "api_key_env": "OPENAI_API_KEY",
            "bos_token": "<|begin_of_text|>", "api_key": "sk-live-abcdef123", "password": "letmein!",
            "HF_TOKEN": "hf_FAKE0123456789", "headers": ["Authorization: Bearer abcdefghijklmnop"]}
    out = scrub(data, [])
    kept = {k: v for k, v in data.items() if k not in ("api_key", "password", "HF_TOKEN", "headers")}
    assert {k: out[k] for k in kept} == kept
    assert out["api_key"] == out["password"] == out["HF_TOKEN"] == MASK
    assert out["headers"] == ["Authorization: Bearer ***"]


def test_a_url_password_is_masked_and_the_rest_of_the_url_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scrub_text("DB_URL=postgres://user:pa55w0rd@host/db", []) == "DB_URL=postgres://user:***@host/db"
    # Known from the environment, the password goes wherever it recurs, not only inside the URL.
    monkeypatch.setenv("DB_URL", "postgres://user:pa55w0rd@host/db")
    assert env_secrets({"DB_URL": "postgres://user:pa55w0rd@host/db"}) == ["pa55w0rd"]
    assert scrub_text("login with pa55w0rd failed") == "login with *** failed"


@pytest.mark.parametrize("command", [
    "vllm serve m --port 8000 --api-key sk-live-abcdef123",
    ["vllm", "serve", "m", "--api-key", "sk-live-abcdef123"],
    ["vllm", "serve", "m", "--api-key=sk-live-abcdef123"],
    ["/bin/sh", "-c", "exec vllm serve m --api-key 'sk-live-abcdef123' > log"],
])
def test_a_secret_flag_of_a_command_is_masked(command: str | list[str]) -> None:
    assert command_secrets(command) == ["sk-live-abcdef123"]
    line = command if isinstance(command, str) else " ".join(command)
    assert "sk-live-abcdef123" not in scrub_text(line, [])
    assert "sk-live-abcdef123" not in json.dumps(scrub({"argv": command}, []))
    # what vLLM prints when it fails to start
    assert scrub_text("non-default args: {'api_key': 'sk-live-abcdef123'}", []) == "non-default args: {'api_key': '***'}"


def test_flags_that_are_not_secrets_keep_their_values() -> None:
    assert command_secrets(["serve", "--max-num-batched-tokens", "8192", "--token-budget", "5000",
                            "--tokenizer-mode", "auto", "--api-key", "{api_key}", "--hf-token-file", "/run/tok"]) == []


def test_an_environment_secret_is_masked_inside_any_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_FAKEabcdefghij")
    monkeypatch.setenv("MAX_TOKENS", "64")  # a number is no secret, whatever its name
    assert scrub_text("Loading with hf_FAKEabcdefghij from cache; max 64") == "Loading with *** from cache; max 64"
    assert scrub({"note": ["x hf_FAKEabcdefghij y"], 64: "hf_FAKEabcdefghij"}) == {"note": ["x *** y"], 64: MASK}


def test_an_escaped_newline_ends_a_masked_value() -> None:
    # A log tail inside --json output: its lines are joined by the two characters \\ and n.
    tail = "HF_TOKEN=hf_FAKE0123abcdefghij\nstarting up\nOPENAI_API_KEY=sk-FAKE0123456789\nready on port 8000"
    masked = scrub_text(json.dumps({"log_tail": tail}), [])
    assert json.loads(masked)["log_tail"] == "HF_TOKEN=***\nstarting up\nOPENAI_API_KEY=***\nready on port 8000"


def test_header_values_are_masked() -> None:
    for text in ("Authorization: Bearer abcdefghijklmnop", "authorization: Basic dXNlcjpwYXNz",
                 "curl -H 'Authorization: Bearer abcdefghijklmnop'", "got bearer eyJhbGciOi.J9xyz"):
        assert "abcdefghijklmnop" not in scrub_text(text, []) and MASK in scrub_text(text, []), text


def test_a_targets_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY_VAR", "sk-from-env-0123")
    ws = parse_workspace(
        "target:\n  kind: server\n  command: vllm serve m --port {port} --api-key sk-live-abcdef123\n"
        "  api_key_env: MY_KEY_VAR\n"
        "  env: {DB_URL: 'postgres://user:pa55w0rd@host/db', SERVICE_TOKEN: svc-0123456789, OMP_NUM_THREADS: 4}\n"
        "scenarios: {chat: {dataset: {kind: random, input_len: 8, output_len: 8}, num_requests: 2}}\n"
        "criteria: [{name: t, metric: output_throughput, op: '>=', value: 1}]\n", tmp_path / "infra-agent.yaml")
    assert set(target_secrets(ws.target)) == {"sk-live-abcdef123", "pa55w0rd", "svc-0123456789", "sk-from-env-0123"}


def test_read_file_shows_source_as_written_and_secrets_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVICE_TOKEN", "svc-FAKE-0123456789")
    (tmp_path / "engine.py").write_text(CODE + "SERVICE = 'svc-FAKE-0123456789'\nDB = 'mysql://root:hunter22@db/x'\n")
    res = default_registry().call("read_file", {"path": "engine.py"}, ToolContext(code_root=tmp_path))
    assert not res.error
    for line in CODE.splitlines():
        assert line in res.text, line
    assert "svc-FAKE-0123456789" not in res.text and "hunter22" not in res.text
    assert "mysql://root:***@db/x" in res.text


def test_tool_text_is_masked_by_value_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a model reads through a tool: the known secrets go wherever they are (keys too), and a URL's
    # password; a name or a credential-like shape masks nothing, since in code it is code.
    monkeypatch.setenv("SERVICE_TOKEN", "svc-FAKE-0123456789")
    code = ('next_token = "tok_0123456789"\npassword = args.password2x\ncache_key=blk_12345678\n'
            'headers = {"Authorization": "Bearer abcdefghijklmnop"}\nurl = f"postgres://{user}:{password}@db/x"\n')
    assert mask_values(code) == code
    assert scrub_text(code) != code  # the patterns by form would have masked some of it
    got = mask_values({"svc-FAKE-0123456789": ["x svc-FAKE-0123456789 y", 64, 0.5, True],
                       "db": "mysql://root:hunter22@db/x", "per_token_ms": 0.25})
    assert got == {MASK: [f"x {MASK} y", 64, 0.5, True], "db": "mysql://root:***@db/x", "per_token_ms": 0.25}
    assert mask_values("key abc123 and sk-given-0123", ["sk-given-0123", "abc", "12345"]) == "key abc123 and ***"


def test_the_console_masks_what_it_prints(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra_agent.cli.output import masked_console

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-FAKE0123456789abcdef")
    buf = io.StringIO()
    con = masked_console(lambda: buf, width=40)
    table = Table("what", "value")
    table.add_row("key", "sk-test-FAKE0123456789abcdef")  # wider than its column: wrapped
    con.print(table)
    con.print("per_token_ms=3.5 sk-test-FAKE0123456789abcdef", markup=False)
    out = buf.getvalue()
    assert "FAKE" not in out and "per_token_ms=3.5 ***" in out


def test_a_workspace_error_does_not_echo_a_secret_env_value(tmp_path: Path) -> None:
    from infra_agent.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_workspace("target:\n  kind: server\n  command: x\n  env: {SERVICE_TOKEN: [svc-0123456789]}\n",
                        tmp_path / "infra-agent.yaml")
    assert "svc-0123456789" not in str(info.value) and MASK in str(info.value)
