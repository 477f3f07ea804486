"""Code changes in git worktrees: never in the user's tree.

Each code experiment gets a worktree of the workspace's repository on a branch of its
own (``infra-agent/<run>-<experiment>-cand``, and ``-base`` for the other side),
checked out from the current best commit.
The diff is applied there and checked *after* it is applied (renames and links
resolved) against the protected paths.  An accepted change becomes a commit on the
run's branch (``infra-agent/<run>``), whose message carries the hypothesis and the
verdict; a rejected one leaves no worktree and no branch.

Worktrees live under ``<workspace>/.infra-agent/worktrees/<run>/``, which the
workspace ignores.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from infra_agent.errors import InfraAgentError

_GIT_ENV = {"GIT_AUTHOR_NAME": "infra-agent", "GIT_AUTHOR_EMAIL": "infra-agent@localhost",
            "GIT_COMMITTER_NAME": "infra-agent", "GIT_COMMITTER_EMAIL": "infra-agent@localhost",
            "GIT_TERMINAL_PROMPT": "0"}


class GitError(InfraAgentError):
    """A git command failed; carries the command and git's own message."""


class PatchRejected(InfraAgentError):
    """A diff that does not apply, or that touches a protected path."""


def git(cwd: Path, *args: str, check: bool = True, input_text: str | None = None) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **_GIT_ENV}, capture_output=True, text=True,
                          input=input_text, check=False)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args[:3])} failed in {cwd}: {(proc.stderr or proc.stdout).strip()[:2000]}")
    return proc.stdout


def repo_root(path: Path) -> Path | None:
    """The top of the git repository holding ``path``, or None outside any."""
    if shutil.which("git") is None:
        return None
    proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True, check=False)
    return Path(proc.stdout.strip()).resolve() if proc.returncode == 0 else None


@dataclass(frozen=True)
class ChangedPath:
    status: str  # git's letter: A, M, D, R, C, T
    path: str  # repo-relative, after the change
    old_path: str | None = None  # the source of a rename or copy


class Worktrees:
    """The worktrees and branches of one run, in the repository holding the workspace."""

    def __init__(self, workspace_root: Path, run_id: str) -> None:
        root = repo_root(workspace_root)
        if root is None:
            raise InfraAgentError(f"{workspace_root} is not inside a git repository: code changes need one "
                                  "(run `git init && git add -A && git commit -m base` there)")
        self.repo = root
        self.workspace_rel = workspace_root.resolve().relative_to(root)
        self.run_id = run_id
        self.base_dir = workspace_root.resolve() / ".infra-agent" / "worktrees" / run_id
        self.run_branch = f"infra-agent/{run_id}"

    def head(self) -> str:
        return git(self.repo, "rev-parse", "HEAD").strip()

    def ensure_run_branch(self, commit: str) -> None:
        if not git(self.repo, "branch", "--list", self.run_branch).strip():
            git(self.repo, "branch", self.run_branch, commit)

    def delete_run_branch(self) -> None:
        """Remove the run's branch (quiet when it does not exist)."""
        if git(self.repo, "branch", "--list", self.run_branch).strip():
            git(self.repo, "branch", "-D", self.run_branch)

    def branch_of(self, name: str) -> str:
        return f"{self.run_branch}-{name}"

    def create(self, name: str, commit: str) -> Path:
        """A fresh worktree named ``name`` at ``commit`` on its own branch; replaces a stale one."""
        self.remove(name)
        path = self.base_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        git(self.repo, "worktree", "add", "-q", "-b", self.branch_of(name), str(path), commit)
        return path

    def workspace_in(self, worktree: Path) -> Path:
        """Where the workspace folder sits inside a worktree."""
        return worktree / self.workspace_rel

    def apply(self, worktree: Path, diff: str) -> list[ChangedPath]:
        """Apply ``diff`` (paths relative to the workspace folder or the repository root) and list what changed."""
        if not diff.strip():
            raise PatchRejected("the diff is empty")
        text = diff if diff.endswith("\n") else diff + "\n"
        # Try repo-relative paths first, then workspace-relative (a diff written from inside the workspace).
        attempts = [worktree] + ([self.workspace_in(worktree)] if str(self.workspace_rel) != "." else [])
        errors = []
        for cwd in attempts:
            proc = subprocess.run(["git", "apply", "--check", "--whitespace=nowarn", "-"], cwd=cwd, input=text, text=True,
                                  capture_output=True, check=False)
            if proc.returncode == 0:
                git(cwd, "apply", "--whitespace=nowarn", "-", input_text=text)
                break
            errors.append(proc.stderr.strip())
        else:
            raise PatchRejected("the diff does not apply: " + (errors[-1] or "git apply refused it")[:1500])
        git(worktree, "add", "-A")
        return self.changed(worktree)

    def changed(self, worktree: Path) -> list[ChangedPath]:
        out = git(worktree, "diff", "--cached", "--name-status", "-M", "-C", "HEAD")
        changes: list[ChangedPath] = []
        for line in out.splitlines():
            parts = line.split("\t")
            status = parts[0][:1]
            if status in ("R", "C") and len(parts) == 3:
                changes.append(ChangedPath(status, parts[2], parts[1]))
            elif len(parts) >= 2:
                changes.append(ChangedPath(status, parts[1]))
        return changes

    def commit(self, worktree: Path, message: str) -> str:
        git(worktree, "add", "-A")
        git(worktree, "commit", "-q", "--no-verify", "-m", message)
        return git(worktree, "rev-parse", "HEAD").strip()

    def advance_run_branch(self, commit: str) -> None:
        """Point the run's branch at an accepted commit (it descends from the branch's tip)."""
        git(self.repo, "branch", "-f", self.run_branch, commit)

    def remove(self, name: str) -> None:
        """Remove a worktree and its branch; quiet when they do not exist."""
        path = self.base_dir / name
        if path.exists():
            git(self.repo, "worktree", "remove", "--force", str(path), check=False)
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
        git(self.repo, "worktree", "prune", check=False)
        git(self.repo, "branch", "-D", self.branch_of(name), check=False)

    def remove_all(self) -> None:
        """Every worktree and temporary branch of this run (the run branch stays: it holds the accepted commits)."""
        if self.base_dir.exists():
            for child in sorted(self.base_dir.iterdir()):
                self.remove(child.name)
            shutil.rmtree(self.base_dir, ignore_errors=True)
        git(self.repo, "worktree", "prune", check=False)
        for line in git(self.repo, "branch", "--list", f"{self.run_branch}-*", check=False).splitlines():
            git(self.repo, "branch", "-D", line.strip().lstrip("*+ ").strip(), check=False)

    def leftovers(self) -> list[str]:
        """Worktrees and branches of this run still present (for tests and cleanup reports)."""
        wts = [line.split(" ", 1)[1] for line in git(self.repo, "worktree", "list", "--porcelain").splitlines()
               if line.startswith("worktree ") and str(self.base_dir) in line]
        branches = [b.strip().lstrip("*+ ").strip()
                    for b in git(self.repo, "branch", "--list", f"{self.run_branch}-*").splitlines()]
        return wts + [b for b in branches if b]


def code_id(ws_dir: Path, user_tree: bool = False) -> str:
    """What code a workspace folder holds, for reusing a check's result.

    A clean checkout is its commit; with changes, the folder and a hash of its diff
    against HEAD (so an edit made between two runs is seen).  The user's own tree also
    keeps its path when clean: it may hold ignored or untracked files (a built
    extension, a new module) that a worktree of the same commit lacks."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ws_dir, capture_output=True, text=True, check=False)
    if head.returncode != 0:
        return str(ws_dir.resolve())
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ws_dir, capture_output=True,
                           text=True, check=False)
    commit = head.stdout.strip()
    if dirty.returncode == 0 and not dirty.stdout.strip():
        return f"{commit}@{ws_dir.resolve()}" if user_tree else commit
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=ws_dir, capture_output=True, check=False).stdout
    return f"{commit}+{hashlib.sha256(diff).hexdigest()[:16]}@{ws_dir.resolve()}"
