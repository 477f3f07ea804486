"""examples/refstack-code under the loop: a code change to refstack, measured from its worktree.

The workspace's tree carries a regression (a blocking call on the event loop, one of the
planted bottlenecks); the scripted stand-in model reads the handler, proposes the diff
that removes it, and asks for the experiment.  The loop applies the diff in a worktree,
launches refstack from each side's tree (``PYTHONPATH=src``) and measures them
interleaved: the fix is supported only if the candidate's server ran the edited code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.ledger import Ledger
from infra_agent.standin.server import received_requests, serve_standin

from ..probes.code_workspace import (
    AUDIT_CALL,
    HANDLER,
    git,
    regressed_workspace,
)

# about 1.5 minutes alone, up to 5 beside the rest of the suite
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

def test_the_llm_proposer_fixes_a_blocking_call_measured_from_the_worktree(tmp_path: Path) -> None:
    ws, diff = regressed_workspace(tmp_path / "ws")
    script = {"turns": [
        {"tool_calls": [{"tool": "read_file", "arguments": {"path": HANDLER, "start_line": 165, "max_lines": 20}}]},
        {"tool_calls": [{"tool": "propose_diff", "arguments": {"diff": diff}}]},
        {"tool_calls": [{"tool": "run_experiment", "arguments": {
            "statement": "The handler's synchronous audit check holds the GIL on the event loop for each request; "
                         "without it the engine's thread stops stalling with the loop and output throughput rises",
            "metric": "output_throughput", "direction": "higher", "min_effect": 0.2, "scenario": "chat",
            "locality": {"component": "server"}}}]},
        {"tool_calls": [{"tool": "finish", "arguments": {"reason": "the fix was measured"}}]},
    ], "on_exhausted": "finish"}
    with serve_standin(script) as url:
        run = start_run(ws, RunOptions(proposer="llm", model="standin", base_url=url, budget_runs=3, confirm=False),
                        progress=False)
        read = [str(m.get("content")) for r in received_requests(url) for m in r.get("messages") or []
                if m.get("role") == "tool"]
    with Ledger.for_workspace(ws) as ledger:
        exps = {e.role: e for e in ledger.experiments(run.id)}
    # The model read the workspace's copy of the handler (the code root is the workspace folder).
    assert any(AUDIT_CALL in text for text in read), read
    exp = exps["experiment"]
    assert exp.status == "done" and exp.verdict is not None, (exp.status, exp.error)
    assert exp.verdict.outcome == "supported" and exp.accepted, exp.verdict
    # The accepted change is the fix, committed on the run's branch; the user's tree keeps the regression.
    fixed = git(ws, "show", f"infra-agent/{run.id}:{HANDLER}")
    assert AUDIT_CALL not in fixed and AUDIT_CALL in (ws / HANDLER).read_text()
    # Both sides ran from worktrees (the candidate's with the fix): the run's gates now pass.
    assert exp.commit is not None and run.status == "done"
