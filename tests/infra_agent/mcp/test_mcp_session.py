"""The MCP session without a transport: budgets, finish, error results, a probe on an experiment's code,
labelled findings (no MCP server is started)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback, Finding, Tier
from infra_agent.mcp.session import McpOptions, McpSession
from infra_agent.records import Change, Experiment, Hypothesis, RunRecord, Verdict

from ..agent.loop_workspace import FAST_DIFF, git, make_workspace

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


def _ledger_experiment(s: McpSession, ws: Path, exp_id: str, diff: str, **fields: object) -> Experiment:
    ledger = s.open_ledger()
    if not ledger.list_runs():
        ledger.create_run(RunRecord(id="r1", workspace=str(ws), proposer="mcp", started_at=time.time()))
    exp = Experiment(id=exp_id, run_id="r1", seq=int(exp_id[1:]), parent="e0", status="done",
                     hypothesis=Hypothesis(statement="a 3 ms step", metric="output_throughput", direction="higher"),
                     change=Change(diff=diff), base_commit=git(ws, "rev-parse", "HEAD").strip(), knobs={"max_running": 8},
                     verdict=Verdict(outcome="inconclusive", effect=1.02, low=0.9, high=1.1), **fields)
    ledger.save_experiment(exp)
    return exp


def test_a_probe_runs_on_an_experiments_code_in_a_worktree_of_its_own(ws: Path) -> None:
    s = McpSession(ws)
    _ledger_experiment(s, ws, "e1", FAST_DIFF)  # not accepted: no commit of its own, so its diff on its parent's
    fast = {"probe": "command", "config": {"command": [sys.executable, "-c", "import sys, tuning; "
                                                       "sys.exit(tuning.STEP_DELAY_MS != 3)"]}}
    res = s.call("run_probe", {**fast, "experiment": "e1"})
    assert not res.error and "on e1's diff on its parent's commit" in res.text, res.text
    assert res.data["knobs"]["max_running"] == 8 and res.data["code"]["experiment"] == "e1"
    assert s.call("run_probe", fast).error  # the tree itself still has the 30 ms step
    assert (ws / "tuning.py").read_text().endswith("STEP_DELAY_MS = 30\n")
    _ledger_experiment(s, ws, "e2", FAST_DIFF.replace("STEP_DELAY_MS = 30", "STEP_DELAY_MS = 31"))
    res = s.call("run_probe", {**fast, "experiment": "e2"})
    assert res.error and "field 'experiment'" in res.text and "does not apply" in res.text, res.text
    res = s.call("run_probe", {**fast, "experiment": "e7"})
    assert res.error and "e7" in res.text
    # Each call's worktree and branch went with it; the session leaves nothing.
    assert s.close() == []
    assert git(ws, "worktree", "list").strip().count("\n") == 0 and "mcp-" not in git(ws, "branch", "--list")


def test_read_findings_says_which_side_each_came_from(ws: Path) -> None:
    s = McpSession(ws)
    side = {"candidate": "feedback", "baseline": "baseline_feedback"}
    _ledger_experiment(s, ws, "e1", FAST_DIFF, **{key: Feedback(probe="serving", tier=Tier.e2e, findings=[Finding(
        kind="queue_dominates_ttft", severity="warning", message=f"{name} requests queue")]) for name, key in side.items()})
    res = s.call("read_findings", {"experiment": "e1", "side": "both"})
    assert not res.error and [f["side"] for f in res.data["findings"]] == ["candidate", "baseline"]
    assert res.text.splitlines()[1:] == ["- candidate: [warning] queue_dominates_ttft: candidate requests queue",
                                         "- baseline: [warning] queue_dominates_ttft: baseline requests queue"]
    res = s.call("read_findings", {"experiment": "e1", "side": "baseline"})
    assert [f["message"] for f in res.data["findings"]] == ["baseline requests queue"]
    s.close()
