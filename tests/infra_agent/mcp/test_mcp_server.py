"""``infra-agent mcp`` end to end: the ``mcp`` package's own client over stdio, on a real refstack.

The server runs as ``python -m infra_agent.mcp`` (the same command as ``infra-agent mcp``)
on the loop tests' small workspace: a git repository whose target is ``refstack serve
--preset tiny``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from infra_agent.agent.executors.cleanup import marked_pids
from infra_agent.ledger import Ledger

from ..agent.loop_workspace import git, make_workspace

SECRET = "sk-mcp-test-0123456789abcdef"


@asynccontextmanager
async def connect(ws: Path, *extra: str, env: dict[str, str] | None = None) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "infra_agent.mcp", "--workspace", str(ws), *extra],
                                   env={**os.environ, **(env or {})}, cwd=str(ws))
    with open(ws.parent / "server-stderr.log", "a") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


def text(res: Any) -> str:
    return "\n".join(c.text for c in res.content if getattr(c, "type", "") == "text")


def err(res: Any) -> bool:
    return bool(getattr(res, "is_error", None) or getattr(res, "isError", None))


def data(res: Any) -> dict[str, Any]:
    return dict(getattr(res, "structured_content", None) or getattr(res, "structuredContent", None) or {})


def workspace(tmp_path: Path) -> Path:
    # max_running starts at 1 under 4 concurrent chats: raising it is a real, measurable change.
    return make_workspace(tmp_path / "ws", extra_knobs={
        "max_running": {"type": "int", "min": 1, "max": 64, "default": 1, "components": ["engine.scheduler"],
                        "help": "Most requests running at once."}})


def test_bad_calls_are_error_results_and_the_session_goes_on(tmp_path: Path) -> None:
    ws = workspace(tmp_path)

    async def main() -> None:
        async with connect(ws, env={"MY_API_TOKEN": SECRET}) as s:
            names = [t.name for t in (await s.list_tools()).tools]
            for name in ("validate_workspace", "list_knobs", "run_probe", "analyze_trace", "diff_traces", "read_file",
                         "search_code", "propose_diff", "set_knobs", "run_experiment", "read_ledger", "finish",
                         "list_runs", "list_experiments", "read_findings"):
                assert name in names, names
            tools = {t.name: t for t in (await s.list_tools()).tools}
            schema = tools["run_experiment"].input_schema if hasattr(tools["run_experiment"], "input_schema") \
                else tools["run_experiment"].inputSchema
            assert {"statement", "metric", "direction"} <= set(schema["required"])
            assert {"knobs", "diff"} <= set(schema["properties"])

            res = await s.call_tool("no_such_tool", {})
            assert err(res) and "unknown tool 'no_such_tool'" in text(res)

            res = await s.call_tool("run_probe", {"probe": "serving", "config": {"repeats": "many"}})
            assert err(res) and "repeats" in text(res) and "expected" in text(res) and "many" in text(res), text(res)

            res = await s.call_tool("run_probe", {"probe": "serving", "config": {"no_such_key": 1}})
            assert err(res) and "no_such_key" in text(res), text(res)

            res = await s.call_tool("run_probe", {"probe": "nope"})
            assert err(res) and "field 'probe'" in text(res), text(res)

            res = await s.call_tool("run_experiment", {"metric": "output_throughput", "direction": "up"})
            assert err(res) and "'statement'" in text(res) and "'direction'" in text(res), text(res)

            res = await s.call_tool("set_knobs", {"knobs": {"max_running": 1000}})
            assert err(res) and "max_running" in text(res) and "1000" in text(res)

            # A protected path is refused before anything runs.
            res = await s.call_tool("propose_diff", {"diff": "--- a/tests/test_tuning.py\n+++ b/tests/test_tuning.py\n"
                                                             "@@ -1,2 +1,2 @@\n def test_tuning():\n-    assert True\n+    assert 1\n"})
            assert err(res) and "protected" in text(res), text(res)

            # Reading a file is confined to the workspace, and a secret of the server's environment is masked.
            (ws / "notes.txt").write_text(f"api_key={SECRET}\n")
            res = await s.call_tool("read_file", {"path": "notes.txt"})
            assert not err(res) and SECRET not in text(res) and "***" in text(res)
            res = await s.call_tool("read_file", {"path": "../outside.txt"})
            assert err(res)

            # A trace source is one of a probe call, an experiment or files; a call that never ran is named.
            res = await s.call_tool("analyze_trace", {"probe_call": "p1", "paths": ["x.json"]})
            assert err(res) and "exactly one of probe_call, experiment or paths" in text(res), text(res)
            res = await s.call_tool("analyze_trace", {"probe_call": "p1"})
            assert err(res) and "field 'probe_call'" in text(res) and "none yet" in text(res), text(res)
            res = await s.call_tool("analyze_trace", {"paths": ["no-such-trace.json"]})
            assert err(res) and "no-such-trace.json" in text(res), text(res)

            # The session goes on.
            res = await s.call_tool("list_knobs", {})
            assert not err(res) and "max_running" in text(res)
            assert data(res)["knobs"][0]["domain"]
            res = await s.call_tool("validate_workspace", {})
            assert not err(res) and data(res)["valid"] and "chat" in data(res)["scenarios"], text(res)
            assert "tests/**" in data(res)["protected"]

    anyio.run(main)


@pytest.mark.slow
def test_full_session_on_refstack(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    progress: dict[str, list[str]] = {"probe": [], "experiment": []}

    def collect(key: str) -> Any:
        async def cb(value: float, total: float | None, message: str | None) -> None:
            progress[key].append(message or "")
        return cb

    async def main() -> tuple[str, str]:
        async with connect(ws, "--budget-runs", "2", "--pairs", "3", env={"MY_API_TOKEN": SECRET}) as s:
            res = await s.call_tool("run_probe", {"probe": "serving", "config": {"scenarios": ["chat"]},
                                                  "knobs": {"max_running": 2}}, progress_callback=collect("probe"))
            assert not err(res), text(res)
            probe = data(res)
            assert probe["ok"] and probe["knobs"]["max_running"] == 2
            assert any(m["name"] == "output_throughput" and m["value"] > 0 for m in probe["measurements"])
            assert "output_throughput" in text(res)

            res = await s.call_tool("run_experiment", {
                "statement": "With max_running=1 the 4 chats queue; running 4 at once raises output throughput",
                "metric": "output_throughput", "direction": "higher", "min_effect": 0.3, "scenario": "chat",
                "locality": {"component": "engine.scheduler", "knob": "max_running"},
                "knobs": {"max_running": 4}}, progress_callback=collect("experiment"))
            assert not err(res), text(res)
            exp = data(res)
            assert exp["id"] == "e1" and exp["status"] == "done" and exp["change"]["knobs"] == {"max_running": 4}
            assert exp["verdict"]["outcome"] == "supported" and exp["verdict"]["accepted"], text(res)
            assert exp["best"] == "e1"
            run_id = exp["run"]

            # The same change again is refused; the budget of 2 leaves one more.
            res = await s.call_tool("run_experiment", {"statement": "again", "metric": "output_throughput",
                                                       "direction": "higher", "knobs": {"max_running": 4}})
            assert err(res) and ("already tried" in text(res) or "changes nothing" in text(res)), text(res)

            res = await s.call_tool("read_ledger", {})
            assert not err(res) and "e0" in text(res) and "e1" in text(res)
            res = await s.call_tool("list_runs", {})
            assert run_id in text(res) and "[mcp]" in text(res)
            res = await s.call_tool("list_experiments", {"run": run_id})
            assert [e["id"] for e in data(res)["experiments"]][:2] == ["e0", "e1"]
            res = await s.call_tool("read_findings", {"experiment": "e0"})
            assert not err(res) and "finding(s) of experiment e0" in text(res)
            res = await s.call_tool("read_findings", {"experiment": "e99"})
            assert err(res) and "e99" in text(res)
            return run_id, SECRET

    run_id, secret = anyio.run(main)
    # Progress came as MCP notifications while the probe and the experiment ran.
    assert progress["probe"] and any("probe serving" in m for m in progress["probe"]), progress
    assert any("window" in m or "starting server" in m for m in progress["experiment"]), progress
    with Ledger.for_workspace(ws) as ledger:
        run = ledger.get_run(run_id)
        exps = {e.id: e for e in ledger.experiments(run_id)}
    assert run.proposer == "mcp" and run.status == "done" and run.best == "e1"
    assert exps["e0"].role == "baseline" and exps["e1"].accepted
    # --pairs 3: each look is a batch of 3 interleaved pairs (6 runs); a loaded machine may leave
    # the first look undecided and take the design's second, so the runs follow the looks taken.
    looks = exps["e1"].sample_plan["looks_taken"]
    assert looks in (1, 2) and exps["e1"].cost.e2e_runs == 6 * looks, (exps["e1"].sample_plan, exps["e1"].cost)
    assert secret not in (ws / ".infra-agent" / "ledger.db").read_bytes().decode(errors="replace")
    # Nothing left running; no worktree left behind.
    assert marked_pids(run_id + "/") == [] and marked_pids("mcp-") == []
    assert git(ws, "worktree", "list").strip().count("\n") == 0


def test_http_transport_lists_tools_and_runs_a_call(tmp_path: Path) -> None:
    import socket
    import subprocess
    import time

    from mcp.client.streamable_http import streamable_http_client

    ws = make_workspace(tmp_path / "ws")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "infra_agent.mcp", "--transport", "http", "--port", str(port),
                             "--workspace", str(ws)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async def main() -> None:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    assert time.monotonic() < deadline and proc.poll() is None, "the HTTP server did not come up"
                    await anyio.sleep(0.2)
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams:
                read, write = streams[0], streams[1]
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    assert "run_experiment" in [t.name for t in (await s.list_tools()).tools]
                    res = await s.call_tool("list_knobs", {})
                    assert not err(res) and "max_running" in text(res)
                    res = await s.call_tool("list_knobs", {"extra": 1})
                    assert err(res) and "'extra'" in text(res)

        anyio.run(main)
    finally:
        proc.terminate()
        assert proc.wait(30) is not None
