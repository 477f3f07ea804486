"""examples/refstack-code through ``infra-agent mcp``: an MCP client measures a change to refstack's code.

The workspace's tree carries a planted regression (a blocking call on the event loop);
the client reads the handler, proposes the diff that removes it and runs the experiment,
through the ``mcp`` package's own client over stdio.  The server runs the loop's
executor: both sides in worktrees, each launching refstack from its own tree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

from infra_agent.ledger import Ledger

from ..probes.code_workspace import (
    AUDIT_CALL,
    HANDLER,
    git,
    regressed_workspace,
)

# about 1.5 minutes alone, up to 5 beside the rest of the suite
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _text(res: object) -> str:
    return "\n".join(c.text for c in getattr(res, "content", []) if getattr(c, "type", "") == "text")


def _failed(res: object) -> bool:
    return bool(getattr(res, "is_error", None) or getattr(res, "isError", None))


def test_an_mcp_client_measures_a_code_change(tmp_path: Path) -> None:
    ws, diff = regressed_workspace(tmp_path / "ws")
    params = StdioServerParameters(command=sys.executable, args=["-m", "infra_agent.mcp", "--workspace", str(ws),
                                                                 "--budget-runs", "2"],
                                   env=dict(os.environ), cwd=str(ws))

    async def main() -> str:
        with open(tmp_path / "server-stderr.log", "a") as errlog:
            async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as s:
                await s.initialize()
                res = await s.call_tool("read_file", {"path": HANDLER, "start_line": 170, "max_lines": 20})
                assert not _failed(res) and AUDIT_CALL in _text(res), _text(res)
                res = await s.call_tool("run_experiment", {
                    "statement": "The handler's synchronous audit check holds the GIL on the event loop for each request; "
                                 "without it the engine's thread stops stalling with the loop and output throughput rises",
                    "metric": "output_throughput", "direction": "higher", "min_effect": 0.2, "scenario": "chat",
                    "locality": {"component": "server"}, "diff": diff})
                assert not _failed(res), _text(res)
                return _text(res)

    text = anyio.run(main)
    with Ledger.for_workspace(ws) as ledger:
        run = ledger.list_runs()[0]
        exps = {e.role: e for e in ledger.experiments(run.id)}
    exp = exps["experiment"]
    assert exp.verdict is not None and exp.verdict.outcome == "supported" and exp.accepted, text
    assert exp.commit is not None and AUDIT_CALL not in git(ws, "show", f"{exp.commit}:{HANDLER}")
