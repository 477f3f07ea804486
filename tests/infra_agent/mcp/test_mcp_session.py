"""The MCP session without a transport: budgets, finish, error results (no server is started)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra_agent.errors import InfraAgentError
from infra_agent.mcp.session import McpOptions, McpSession

from ..agent.loop_workspace import make_workspace

HYPOTHESIS = {"statement": "a larger batch raises throughput", "metric": "output_throughput", "direction": "higher",
              "knobs": {"max_running": 8}}


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


def test_budgets_refuse_before_anything_starts(ws: Path) -> None:
    s = McpSession(ws, McpOptions(budget_runs=1, budget_s=60))
    s.experiments_run = 1
    res = s.call("run_experiment", HYPOTHESIS)
    assert res.error and "experiment budget is spent" in res.text and s.run is None
    s.started = time.monotonic() - 61
    for name, args in (("run_experiment", HYPOTHESIS), ("run_probe", {"probe": "serving"})):
        res = s.call(name, args)
        assert res.error and "wall budget of 60 s is spent" in res.text, res.text
    assert s.close() == []


def test_finish_closes_the_session_for_experiments(ws: Path) -> None:
    s = McpSession(ws)
    res = s.call("finish", {"reason": "nothing to do"})
    assert not res.error
    res = s.call("run_experiment", HYPOTHESIS)
    assert res.error and "closed (finished: nothing to do)" in res.text
    s.close()


def test_invalid_inline_change_names_the_field(ws: Path) -> None:
    s = McpSession(ws)
    res = s.call("run_experiment", {**HYPOTHESIS, "knobs": {"max_running": 0}})
    assert res.error and "field 'knobs'" in res.text and "max_running" in res.text, res.text
    res = s.call("run_experiment", {**HYPOTHESIS, "knobs": None, "diff": "--- a/tests/test_tuning.py\n+++ b/tests/test_tuning.py\n"
                                                                          "@@ -1 +1 @@\n-x\n+y\n"})
    assert res.error and "field 'diff'" in res.text and "protected" in res.text, res.text
    # Checked before anything opened or ran: no run, no baseline, and the pending change is as it was.
    assert s.run is None and s.ctx.pending.empty
    s.close()


def test_progress_messages_are_scrubbed(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_API_KEY", "verysecretvalue123")
    s = McpSession(ws)
    seen: list[str] = []
    s._sink = seen.append
    s.report("server said verysecretvalue123")
    assert seen == ["server said ***"]


def test_a_broken_workspace_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "infra-agent.yaml").write_text("target: {kind: server}\n")
    with pytest.raises(InfraAgentError):
        McpSession(tmp_path)
