"""The local executor's git and process plumbing, without servers: sides, the check cache's key,
the confirmation's checks, the run's branch after a kill, exact process markers, the event reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra_agent.agent.executors.cleanup import MARKER_ENV, marked_pids
from infra_agent.agent.executors.jobs import _forward
from infra_agent.agent.executors.local import LocalExecutor
from infra_agent.agent.executors.worktree import Worktrees, code_id
from infra_agent.records import Change, Experiment, Hypothesis
from infra_agent.workspace import load_workspace

from .loop_workspace import FAST_DIFF, git, make_workspace

# Passes only where tuning.py has the fast step: tells the user's tree from the best's commit.
FAST_CHECK = {"name": "fast", "probe": "command", "components": ["engine"],
              "config": {"command": [sys.executable, "-c", "import sys, tuning; sys.exit(tuning.STEP_DELAY_MS != 3)"]}}


def _exp(exp_id: str, **kw: object) -> Experiment:
    return Experiment(id=exp_id, run_id="rt", seq=int(exp_id[1:]), parent="e0",
                      hypothesis=Hypothesis(statement="s", metric="output_throughput", direction="higher"), **kw)  # type: ignore[arg-type]


def _fast_commit(root: Path) -> str:
    wt = Worktrees(root, "rt")
    path = wt.create("prep", wt.head())
    wt.apply(path, FAST_DIFF)
    commit = wt.commit(path, "fast step")
    wt.remove("prep")
    return commit


@pytest.mark.slow
def test_confirmation_checks_run_on_the_best_commit_not_the_users_tree(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws", checks=[FAST_CHECK])
    ws = load_workspace(root)
    commit = _fast_commit(root)
    ex = LocalExecutor(ws, "rt")
    on_tree = ex.measure(_exp("e0", role="baseline"), [], 0, ["fast"])
    assert on_tree.status == "done" and not on_tree.checks["fast"].ok
    best = ex.measure(_exp("e5", role="confirm", commit=commit), [], 0, ["fast"])
    assert best.status == "done" and best.checks["fast"].ok, best.checks["fast"].error
    ex.finalize(_exp("e5", role="confirm", commit=commit), False, "")
    assert Worktrees(root, "rt").leftovers() == []


def test_check_cache_tells_the_users_tree_from_a_worktree_and_sees_edits(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws")
    wt = Worktrees(root, "rt")
    clean = wt.create("x", wt.head())
    try:
        # Same commit, but the user's tree may hold ignored or untracked files a worktree lacks.
        assert code_id(wt.workspace_in(clean)) == wt.head()
        assert code_id(root, user_tree=True) != code_id(wt.workspace_in(clean))
        # An edit between two runs changes the key, and so does a second edit.
        (root / "tuning.py").write_text("STEP_DELAY_MS = 7\n")
        first = code_id(root, user_tree=True)
        (root / "tuning.py").write_text("STEP_DELAY_MS = 8\n")
        assert first != code_id(root, user_tree=True)
    finally:
        wt.remove_all()


def test_the_base_side_stays_on_the_commit_the_baseline_measured(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws")
    ws = load_workspace(root)
    ex = LocalExecutor(ws, "rt")
    base = _exp("e0", role="baseline")
    ex.measure(base, [], 0, [])
    assert base.base_commit == git(root, "rev-parse", "HEAD").strip()
    # The user commits in their tree while the run goes on.
    (root / "other.py").write_text("x = 1\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "meanwhile")
    exp = _exp("e1", change=Change(diff=FAST_DIFF))
    a_dir, b_dir = ex._sides(exp, base)
    try:
        assert git(a_dir, "rev-parse", "HEAD").strip() == base.base_commit == exp.base_commit
        assert not (a_dir / "other.py").exists() and "STEP_DELAY_MS = 3" in (b_dir / "tuning.py").read_text()
    finally:
        ex.finalize(exp, False, "")
    assert Worktrees(root, "rt").leftovers() == []


def test_restore_points_the_run_branch_at_the_best_after_a_kill_mid_commit(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws")
    ws = load_workspace(root)
    stray = _fast_commit(root)
    wt = Worktrees(root, "rt")
    # Killed after the branch moved to a commit the ledger never recorded.
    wt.ensure_run_branch(stray)
    ex = LocalExecutor(ws, "rt")
    ex.restore(_exp("e0", role="baseline"))  # nothing accepted: no branch
    assert git(root, "branch", "--list", "infra-agent/rt").strip() == ""
    good = _fast_commit(root)
    ex.restore(_exp("e3", commit=good))
    assert git(root, "rev-parse", "infra-agent/rt").strip() == good


def test_restore_is_quiet_outside_git(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws")
    ws = load_workspace(root)
    subprocess.run(["rm", "-rf", str(root / ".git")], check=True)
    LocalExecutor(ws, "rt").restore(_exp("e0", role="baseline"))


def test_an_experiment_marker_is_exact_and_a_run_marker_a_prefix() -> None:
    env = {**os.environ, MARKER_ENV: "rmark/e12"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        assert marked_pids("rmark/e1") == []
        assert marked_pids("rmark/e12") == [proc.pid]
        assert marked_pids("rmark/") == [proc.pid]
    finally:
        proc.kill()
        proc.wait()


def test_the_event_reader_drains_the_pipe_when_the_callback_fails() -> None:
    # 200k events (several MB): a reader that stopped at the first failing callback would
    # leave the writer blocked on a full pipe.
    code = "import sys\nfor i in range(200000): sys.stdout.write('{\"event\": \"run\", \"pair\": %d}\\n' % i)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    calls = []

    def bad(ev: dict) -> None:  # type: ignore[type-arg]
        calls.append(ev)
        raise RuntimeError("display broke")

    _forward(proc, bad)
    assert proc.wait(timeout=60) == 0 and len(calls) == 200000


def test_a_fresh_round_runs_a_check_again_instead_of_reusing_it(tmp_path: Path) -> None:
    # The check appends a line per run: what ran, not what the cache says, is counted.
    runs = tmp_path / "runs.txt"
    counting = {"name": "count", "probe": "command", "components": ["engine"],
                "config": {"command": [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x\\n')"]}}
    root = make_workspace(tmp_path / "ws", checks=[counting])
    ex = LocalExecutor(load_workspace(root), "rt")
    first = ex.measure(_exp("e0", role="baseline"), [], 0, ["count"])
    again = ex.measure(_exp("e1"), [], 0, ["count"])
    assert runs.read_text().count("x") == 1 and again.checks["count"].meta.get("reused_from") == "e0"
    with ex.fresh_checks():
        fresh = ex.measure(_exp("e1"), [], 0, ["count"])
    assert runs.read_text().count("x") == 2 and "reused_from" not in fresh.checks["count"].meta
    assert not ex.fresh and first.checks["count"].ok
    # The cache keeps the first run it saw: a later plain call still names e0.
    assert ex.measure(_exp("e2"), [], 0, ["count"]).checks["count"].meta.get("reused_from") == "e0"
