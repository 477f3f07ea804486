"""Protected paths are checked on what a diff did, after it is applied in a real worktree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra_agent.agent.executors.protect import check_changes, matches
from infra_agent.agent.executors.worktree import PatchRejected, Worktrees
from infra_agent.workspace.models import DEFAULT_PROTECTED

from .loop_workspace import FAST_DIFF, PROTECTED_DIFF, git, make_workspace


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_workspace(tmp_path / "ws")


def _apply(repo: Path, diff: str, name: str = "x") -> list:  # type: ignore[type-arg]
    wt = Worktrees(repo, "rtest")
    path = wt.create(name, wt.head())
    try:
        changes = wt.apply(path, diff)
        check_changes(path, wt.workspace_rel, changes, list(DEFAULT_PROTECTED))
        return changes
    finally:
        wt.remove_all()


def test_glob_semantics() -> None:
    assert matches("tests/a/b.py", ["tests/**"]) == "tests/**"
    assert matches("test_x.py", ["**/test_*.py"]) and matches("pkg/test_x.py", ["**/test_*.py"])
    assert matches("src/tests.py", ["tests/**"]) is None
    assert matches("infra-agent.yaml", DEFAULT_PROTECTED)


def test_a_plain_code_change_passes(repo: Path) -> None:
    changes = _apply(repo, FAST_DIFF)
    assert [(c.status, c.path) for c in changes] == [("M", "tuning.py")]


def test_editing_a_test_is_refused_with_the_path(repo: Path) -> None:
    with pytest.raises(PatchRejected, match=r"tests/test_tuning.py, a protected path"):
        _apply(repo, PROTECTED_DIFF)


def test_renaming_a_protected_file_away_is_refused(repo: Path) -> None:
    diff = ("diff --git a/tests/test_tuning.py b/helpers.py\nsimilarity index 100%\n"
            "rename from tests/test_tuning.py\nrename to helpers.py\n")
    with pytest.raises(PatchRejected, match=r"renames tests/test_tuning.py"):
        _apply(repo, diff)


def test_a_symlink_out_of_the_tree_is_refused(repo: Path) -> None:
    diff = ("diff --git a/etc b/etc\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n+++ b/etc\n"
            "@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n")
    with pytest.raises(PatchRejected, match=r"outside the worktree"):
        _apply(repo, diff)


def test_a_symlink_onto_a_protected_file_is_refused(repo: Path) -> None:
    diff = ("diff --git a/spec_link.py b/spec_link.py\nnew file mode 120000\nindex 0000000..1111111\n--- /dev/null\n"
            "+++ b/spec_link.py\n@@ -0,0 +1 @@\n+tests/test_tuning.py\n\\ No newline at end of file\n")
    with pytest.raises(PatchRejected, match=r"protected path"):
        _apply(repo, diff)


def test_a_diff_that_does_not_apply_says_why(repo: Path) -> None:
    bad = FAST_DIFF.replace("STEP_DELAY_MS = 30", "STEP_DELAY_MS = 31")
    with pytest.raises(PatchRejected, match=r"does not apply"):
        _apply(repo, bad)


def test_dotdot_paths_never_leave_the_worktree(repo: Path) -> None:
    diff = "--- a/../outside.py\n+++ b/../outside.py\n@@ -0,0 +1 @@\n+x = 1\n"
    with pytest.raises(PatchRejected):
        _apply(repo, diff)
    assert not (repo.parent / "outside.py").exists()


def test_worktrees_leave_nothing_behind(repo: Path) -> None:
    wt = Worktrees(repo, "rclean")
    a = wt.create("e1-cand", wt.head())
    wt.apply(a, FAST_DIFF)
    commit = wt.commit(a, "keep")
    wt.ensure_run_branch(wt.head())
    wt.advance_run_branch(commit)
    assert wt.leftovers()
    wt.remove_all()
    assert wt.leftovers() == []
    assert git(repo, "rev-parse", "infra-agent/rclean").strip() == commit  # the accepted commit stays on the run branch
    assert "STEP_DELAY_MS = 30" in (repo / "tuning.py").read_text()  # the user's tree is untouched
    assert os.listdir(repo / ".infra-agent" / "worktrees") == [] if (repo / ".infra-agent" / "worktrees").exists() else True
