"""No secret reaches any byte infra-agent writes: the real CLI and MCP server, fake secrets everywhere.

Secrets sit where a new user has them: in the environment (``OPENAI_API_KEY``,
``HF_TOKEN``), in the workspace's ``target.env`` (a password inside ``DB_URL``, a
``SERVICE_TOKEN``) and in the launch command (``--api-key``).  The target is a server
that fails to start and prints its whole environment and argv to its log first, as a
vLLM that fails prints its non-default args.  Then ``validate``, ``bench`` and ``run``
(each as ``--json`` and as rich text) and an MCP session (``validate_workspace``,
``read_file`` of a file holding the secrets, ``run_probe`` on the failing target) run
as subprocesses, and every byte they wrote is searched: stdout, stderr, MCP results and
progress, the ledger, the reports, the workers' logs and results, and the lines
infra-agent itself writes into the server logs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from mcp import ClientSession, StdioServerParameters, stdio_client

OPENAI_KEY = "sk-test-FAKEopenai0123456789"
HF_TOKEN = "hf_FAKEhub0123456789abcdef"
SERVICE_TOKEN = "svc-FAKE-9a8b7c6d5e4f3210"
DB_PASSWORD = "pa55w0rd"
CMD_KEY = "sk-live-FAKEcmd0123456789"
SECRETS = (OPENAI_KEY, HF_TOKEN, SERVICE_TOKEN, DB_PASSWORD, CMD_KEY)

# Prints everything a careless server would, then fails before it is ready.
FAILING_SERVER = f'''\
import os, sys
for k, v in sorted(os.environ.items()):
    print(f"{{k}}={{v}}")
print("argv:", sys.argv)
print("non-default args:", {{"api_key": sys.argv[sys.argv.index("--api-key") + 1]}})
print("connecting to", os.environ["DB_URL"], "with password", "{DB_PASSWORD}")
sys.exit(1)
'''
# Code and metric names that word-based masking used to mangle, beside the secrets.
NOTES = (f"OPENAI_API_KEY={OPENAI_KEY}\nhf token {HF_TOKEN} and {SERVICE_TOKEN}\n"
         f"db postgres://user:{DB_PASSWORD}@host/db, api {CMD_KEY}\n"
         "per_token_ms = 0.25\nbatch.sort(key=lambda x: x)\ntoken_ids = tokenizer.encode(prompt)\nmax_batch_tokens: 64\n")
INTACT = ("per_token_ms = 0.25", "batch.sort(key=lambda x: x)", "token_ids = tokenizer.encode(prompt)",
          "max_batch_tokens: 64")


@dataclass
class Written:
    ws: Path
    outputs: dict[str, bytes] = field(default_factory=dict)  # what each command or call printed
    codes: dict[str, int] = field(default_factory=dict)

    def files(self) -> Iterator[Path]:
        return (p for p in sorted((self.ws / ".infra-agent").rglob("*")) if p.is_file())


def _workspace(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "fail.py").write_text(FAILING_SERVER)
    (root / "notes.txt").write_text(NOTES)
    spec = {
        "name": "secrets",
        "target": {"kind": "server", "command": [sys.executable, "fail.py", "--port", "{port}", "--api-key", CMD_KEY],
                   "ready_url": "/health", "ready_timeout_s": 30, "stop_grace_s": 2,
                   "env": {"DB_URL": f"postgres://user:{DB_PASSWORD}@host/db", "SERVICE_TOKEN": SERVICE_TOKEN}},
        "knobs": {"max_running": {"type": "int", "min": 1, "max": 64, "default": 4, "components": ["engine.scheduler"]}},
        "scenarios": {"chat": {"dataset": {"kind": "random", "input_len": 8, "output_len": 4, "seed": 0},
                               "endpoint": "chat", "num_requests": 2, "max_concurrency": 1}},
        "criteria": [{"name": "tput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 1e6}],
    }
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    return root


def _env() -> dict[str, str]:
    return {**os.environ, "OPENAI_API_KEY": OPENAI_KEY, "HF_TOKEN": HF_TOKEN, "PYTHONUNBUFFERED": "1"}


def _cli(out: Written, name: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", *args], env=_env(), cwd=out.ws.parent,
                          capture_output=True, timeout=240, check=False)
    out.outputs[f"{name} stdout"], out.outputs[f"{name} stderr"] = proc.stdout, proc.stderr
    out.codes[name] = proc.returncode


@asynccontextmanager
async def _mcp(ws: Path, errlog: Path) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "infra_agent.mcp", "--workspace", str(ws)],
                                   env=_env(), cwd=str(ws))
    with errlog.open("a") as err:
        async with stdio_client(params, errlog=err) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


def _mcp_session(out: Written) -> None:
    errlog = out.ws.parent / "mcp-stderr.log"
    messages: list[str] = []

    async def collect(progress: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")

    async def main() -> None:
        async with _mcp(out.ws, errlog) as s:
            calls: list[tuple[str, dict[str, Any]]] = [
                ("validate_workspace", {}), ("read_file", {"path": "notes.txt"}),
                ("run_probe", {"probe": "serving", "config": {"scenarios": ["chat"]}})]
            for name, args in calls:
                res = await s.call_tool(name, args, progress_callback=collect)
                structured = getattr(res, "structured_content", None) or getattr(res, "structuredContent", None)
                text = "\n".join(getattr(c, "text", "") for c in res.content)
                out.outputs[f"mcp {name}"] = (text + "\n" + json.dumps(structured)).encode()
                out.codes[f"mcp {name}"] = int(bool(getattr(res, "is_error", None) or getattr(res, "isError", None)))

    anyio.run(main)
    assert messages, "the probe sent no progress"
    out.outputs["mcp progress"] = "\n".join(messages).encode()
    out.outputs["mcp stderr"] = errlog.read_bytes()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    out = Written(_workspace(tmp_path_factory.mktemp("secrets") / "ws"))
    ws = str(out.ws)
    for json_flag in (["--json"], []):
        tag = " --json" if json_flag else ""
        _cli(out, "validate" + tag, "validate", ws, *json_flag)
        _cli(out, "bench" + tag, "bench", ws, "--result-dir", str(out.ws / ".infra-agent" / "bench"), *json_flag)
        _cli(out, "run" + tag, "run", ws, "--budget-runs", "1", *json_flag)
    _mcp_session(out)
    return out


def _server_log(path: Path) -> bool:
    return path.parent.name == "logs" and path.name.startswith("server-")


def test_the_commands_fail_as_a_user_sees_them(written: Written) -> None:
    # Otherwise the search below could pass on output that never held the log tail.
    assert written.codes["validate --json"] == 0 and written.codes["validate"] == 0
    assert written.codes["bench --json"] == 2 and written.codes["bench"] == 2
    assert written.codes["run --json"] == 1 and written.codes["run"] == 1
    assert written.codes["mcp validate_workspace"] == 0 and written.codes["mcp read_file"] == 0
    assert written.codes["mcp run_probe"] == 1
    for name in ("bench --json stdout", "bench stderr", "run --json stdout", "run stderr", "mcp run_probe"):
        text = written.outputs[name].decode()
        assert "exited before it was ready" in text and "OPENAI_API_KEY=***" in text, name
        assert "postgres://user:***@host/db" in text and "'api_key': '***'" in text, name
    assert any(_server_log(p) for p in written.files())
    assert (written.ws / ".infra-agent" / "ledger.db").is_file()
    assert list((written.ws / ".infra-agent" / "bench").glob("*.json"))  # the failed run's result files
    assert list((written.ws / ".infra-agent" / "reports").rglob("report.html"))


def test_no_secret_in_any_byte_written(written: Written) -> None:
    found: list[str] = []
    for name, data in written.outputs.items():
        found += [f"{name}: {s}" for s in SECRETS if s.encode() in data]
    for path in written.files():
        data = path.read_bytes()
        if _server_log(path):
            # What infra-agent writes into a server's log; the server's own output follows
            # (see test_the_server_log_on_disk_is_masked).
            data = b"".join(line for line in data.splitlines(keepends=True) if line.startswith(b"# "))
            assert data
        found += [f"{path.relative_to(written.ws)}: {s}" for s in SECRETS if s.encode() in data]
    assert not found, "\n".join(found)


def test_secrets_are_masked_where_they_were_and_nothing_else(written: Written) -> None:
    data = json.loads(written.outputs["validate --json stdout"])
    target = data["workspace"]["target"]
    assert target["env"] == {"DB_URL": "postgres://user:***@host/db", "SERVICE_TOKEN": "***"}
    assert target["command"][-2:] == ["--api-key", "***"]
    read = written.outputs["mcp read_file"].decode()
    for line in INTACT:
        assert line in read, line
    assert "OPENAI_API_KEY=***" in read and "postgres://user:***@host/db" in read
    assert "--api-key ***" in written.outputs["mcp validate_workspace"].decode()


def test_the_server_log_on_disk_is_masked(written: Written) -> None:
    logs = [p.read_bytes() for p in written.files() if _server_log(p)]
    assert logs and not any(s.encode() in log for s in SECRETS for log in logs)
