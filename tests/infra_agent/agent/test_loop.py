"""The loop end to end on a real refstack: code changes in worktrees, verdicts, commits, timeouts.

The llm proposer talks over HTTP to the package's deterministic stand-in chat server,
which plays a script of tool calls (a stand-in for a hosted model).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.executors.cleanup import marked_pids
from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.ledger import Ledger
from infra_agent.standin.server import received_requests, serve_standin

from .loop_workspace import git, llm_script, make_workspace

pytestmark = pytest.mark.slow


def test_llm_code_change_is_tested_in_a_worktree_and_committed(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path / "ws")
    with serve_standin(llm_script()) as url:
        run = start_run(ws, RunOptions(proposer="llm", model="standin", base_url=url, budget_runs=3, confirm=False),
                        progress=False)
        sent = received_requests(url)
    with Ledger.for_workspace(ws) as ledger:
        exps = ledger.experiments(run.id)
    by_role = {e.role: e for e in exps}
    base, exp = by_role["baseline"], by_role["experiment"]
    assert base.status == "done" and run.gates_before[0].outcome == "fail"
    # The diff ran in a worktree; the faster step was supported on interleaved runs and kept.
    assert exp.status == "done" and exp.probe is not None and exp.probe.name == "serving"
    assert exp.verdict is not None and exp.verdict.outcome == "supported" and exp.accepted, exp.verdict
    assert exp.verdict.low is not None and exp.verdict.low > 1.2
    # Both sides' windows of every batch it looked at (3 pairs a batch; a second look when the first,
    # at the sequential design's wider level, left it undecided on a loaded machine).
    assert exp.sample_plan is not None and exp.sample_plan["design"]["batch"] == 3
    assert exp.cost.e2e_runs == 6 * exp.sample_plan["looks_taken"] and exp.cost.llm_tokens > 0
    # The accepted change is a commit on the run's branch, message carrying hypothesis and verdict;
    # the user's tree is untouched.
    log = git(ws, "log", "-1", "--format=%B", f"infra-agent/{run.id}")
    assert "cutting it from 30 to 3 ms" in log and "Verdict: supported" in log
    assert "STEP_DELAY_MS = 3" in git(ws, "show", f"infra-agent/{run.id}:tuning.py")
    assert "STEP_DELAY_MS = 30" in (ws / "tuning.py").read_text()
    assert exp.commit == git(ws, "rev-parse", f"infra-agent/{run.id}").strip()
    # The verdict went back to the model as the tool result, and the model finished.
    assert any("supported" in str(m.get("content", "")).lower() for r in sent for m in r.get("messages") or []
               if m.get("role") == "tool")
    assert run.status == "done"
    # Nothing left behind.
    assert marked_pids(run.id + "/") == []
    assert git(ws, "worktree", "list").strip().count("\n") == 0
    assert git(ws, "branch", "--list", f"infra-agent/{run.id}-*").strip() == ""


# Far below the hung check's 300 s, far above a `sleep 0` check's start on a loaded machine
# (the baseline's own check must not time out).
CHECK_TIMEOUT_S = 15


def test_hung_probe_is_killed_and_the_loop_goes_on(tmp_path: Path) -> None:
    # A unit check that sleeps when the knob says so: the experiment that sets it hangs
    # and is killed at the timeout; the next rule's experiment still runs.
    ws = make_workspace(
        tmp_path / "ws",
        extra_knobs={"check_sleep_s": {"type": "int", "min": 0, "max": 600, "default": 0, "components": ["engine.loop"]}},
        checks=[{"name": "unit", "probe": "command", "components": ["engine.loop"],
                 "config": {"command": ["python3", "-c", "import sys, time; time.sleep(int(sys.argv[1]))", "{check_sleep_s}"]}}],
        criteria=[{"name": "chat-throughput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 1e6}],
    )
    playbook = tmp_path / "playbook.yaml"
    playbook.write_text(
        "rules:\n"
        "  - name: hang\n    change: {knob: [check_sleep_s], set: 300}\n"
        "    hypothesis: {statement: 'sleeping checks change nothing', metric: output_throughput, direction: higher}\n"
        "  - name: batch\n    change: {knob: [max_running], set: 8}\n"
        "    hypothesis: {statement: 'a larger batch raises throughput', metric: output_throughput, direction: higher}\n")
    run = start_run(ws, RunOptions(proposer="rules", playbook=str(playbook), budget_runs=2, confirm=False,
                                   check_timeout_s=CHECK_TIMEOUT_S), progress=False)
    with Ledger.for_workspace(ws) as ledger:
        exps = [e for e in ledger.experiments(run.id) if e.role == "experiment"]
    assert len(exps) == 2, (run.status, run.message)
    hung, nxt = exps
    assert hung.status == "timeout" and f"timed out after {CHECK_TIMEOUT_S} s" in (hung.error or "")
    assert hung.cost.wall_s < 200  # killed, not waited out (the check sleeps 300 s)
    assert nxt.status == "done" and nxt.change.knobs == {"max_running": 8}
    assert marked_pids(run.id + "/") == []


def test_baseline_that_cannot_start_stops_the_run_with_the_log_tail(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path / "ws", command=["python3", "-c", "import sys; print('no GPU here'); sys.exit(3)", "{port}",
                                                  "{max_running}"])
    run = start_run(ws, RunOptions(proposer="rules", budget_runs=1), progress=False)
    assert run.status == "error"
    assert "baseline could not be measured" in run.message and "no GPU here" in run.message
    assert marked_pids(run.id + "/") == []
