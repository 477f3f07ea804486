"""Where a result was measured (host, CPU, GPUs, versions, git commit), its automatic
name under --result-dir, and progress lines when stderr is not a terminal."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.serving.client import RequestRecord
from infra_agent.serving.progress import BenchProgress
from infra_agent.serving.results import result_filename
from infra_agent.serving.runner import run_workspace_scenario
from infra_agent.workspace import load_workspace

runner = CliRunner()
LOAD = ["--num-requests", "4", "--max-concurrency", "2", "--input-len", "8", "--output-len", "4", "--no-progress"]


def test_result_records_backend_tokenizer_and_environment(fake_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    res = runner.invoke(app, ["bench", fake_server.url, *LOAD, "--endpoint", "chat", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["backend"] == "openai-chat" and data["tokenizer_id"] == "byte" and data["model_id"] == "fake-model"
    env = data["environment"]
    assert env["hostname"] and env["cpu_count"] >= 1 and env["cpu_model"] and isinstance(env["gpus"], list)
    versions = env["versions"]
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"infra-agent", "aiohttp", "numpy"} <= set(versions)
    # Versions come from package metadata and GPUs from nvidia-smi: torch is never imported for them.
    probe = "import sys; from infra_agent.serving.results import environment_info; environment_info(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_result_dir_names_the_file_like_vllm(fake_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out_dir = tmp_path / "results"
    for extra in ([], ["--request-rate", "50"]):
        res = runner.invoke(app, ["bench", fake_server.url, *LOAD, *extra, "--result-dir", str(out_dir)])
        assert res.exit_code == 0, res.output
    names = sorted(p.name for p in out_dir.iterdir())
    results = [n for n in names if n.endswith(".json")]
    assert len(results) == 2 and len(names) == 4, names
    assert any(re.fullmatch(r"openai-infqps-concurrency2-fake-model-\d{8}-\d{6}\.json", n) for n in results), results
    assert any(re.fullmatch(r"openai-50qps-concurrency2-fake-model-\d{8}-\d{6}(-2)?\.json", n) for n in results), results
    for name in results:
        data = json.loads((out_dir / name).read_text())
        jsonl = out_dir / name.replace(".json", ".requests.jsonl")
        assert data["requests_file"] == str(jsonl) and len(jsonl.read_text().splitlines()) == 4
    both = runner.invoke(app, ["bench", fake_server.url, *LOAD, "--result-dir", str(out_dir), "-o", str(tmp_path / "x.json")])
    assert both.exit_code == 2


def test_result_filename() -> None:
    from datetime import datetime

    when = datetime(2026, 1, 2, 3, 4, 5)
    assert result_filename("openai", float("inf"), None, "org/Llama-3 8B", when) == "openai-infqps-Llama-3_8B-20260102-030405.json"
    assert result_filename("openai-chat", 2.5, 16, None, when) == "openai-chat-2.5qps-concurrency16-unknown-20260102-030405.json"


def test_workspace_result_records_its_git_commit(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws_dir = fake_workspace(num_requests=2)
    outside = run_workspace_scenario(load_workspace(ws_dir), progress=False, log_dir=tmp_path / "logs")
    assert outside["workspace"] == {"name": None, "path": str(ws_dir), "git": None}
    (ws_dir / ".gitignore").write_text(".infra-agent/\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ws_dir), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "ws")
    ws = load_workspace(ws_dir)
    clean = run_workspace_scenario(ws, progress=False, log_dir=tmp_path / "logs")
    assert clean["workspace"]["git"] == {"commit": git("rev-parse", "HEAD"), "dirty": False}
    with (ws_dir / "infra-agent.yaml").open("a") as f:
        f.write("# a local edit\n")
    dirty = run_workspace_scenario(ws, progress=False, log_dir=tmp_path / "logs")
    assert dirty["workspace"]["git"]["dirty"] is True


def test_progress_lines_reach_a_pipe_while_the_run_goes(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # stderr is a pipe here, as in CI: a rich bar would print nothing until the end.
    srv = fake_server_factory("--token-delay-ms", "25")
    proc = subprocess.Popen(
        [sys.executable, "-m", "infra_agent.cli.main", "bench", srv.url, "--num-requests", "40", "--max-concurrency", "2",
         "--input-len", "8", "--output-len", "8", "-o", str(tmp_path / "r.json")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    try:
        first = proc.stderr.readline()
        running = proc.poll() is None
        rest = proc.stderr.read()
    finally:
        proc.wait(timeout=60)
    assert running, "the first progress line came only at the end"
    lines = [first, *rest.splitlines()]
    assert re.fullmatch(r"bench: 4/40 requests, 0 failed, \d+\.\d s\n", first), first
    assert re.fullmatch(r"bench: 40/40 requests, 0 failed, \d+\.\d s", lines[-1]), lines[-1]
    assert len(lines) == 10  # every 10%
    quiet = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "bench", srv.url, *LOAD], capture_output=True, text=True, check=False)
    assert quiet.returncode == 0 and "bench:" not in quiet.stderr


def test_progress_prints_every_interval_even_without_answers() -> None:
    stream = io.StringIO()

    async def slow_window() -> None:
        async with BenchProgress(200, True, stream=stream, every_s=0.2) as bar:
            await asyncio.sleep(0.5)
            bar.advance(RequestRecord(success=False))

    started = time.monotonic()
    asyncio.run(slow_window())
    assert time.monotonic() - started < 2
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("bench: 0/200 requests, 0 failed, 0.") for line in lines), lines

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert BenchProgress(10, True, stream=Terminal()).mode == "bar"  # a terminal gets the rich bar
    assert BenchProgress(10, False, stream=Terminal()).mode == "off"
