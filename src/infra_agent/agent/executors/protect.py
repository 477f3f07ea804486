"""Protected paths: what a change may never touch (the guard against reward hacking).

Checked on what the diff *did*, after ``git apply`` in the worktree, not on what its
header says: both sides of a rename or copy count, every changed path is resolved
(symlinks included) inside the worktree, and a new or changed symlink is refused when
its target leaves the tree or lands on a protected path.  Patterns are globs relative
to the workspace folder or to the repository root: ``**`` crosses folders, ``*``
does not, and a leading ``**/`` also matches at the top.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path, PurePosixPath

from infra_agent.agent.executors.worktree import ChangedPath, PatchRejected


@lru_cache(maxsize=256)
def _compile(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def matches(path: str, patterns: Iterable[str]) -> str | None:
    """The first pattern ``path`` (posix, relative) matches, or None."""
    p = str(PurePosixPath(path))
    for pat in patterns:
        if _compile(pat.strip("/")).match(p):
            return pat
    return None


def check_changes(worktree: Path, workspace_rel: Path, changes: list[ChangedPath], patterns: list[str]) -> None:
    """Raise ``PatchRejected`` naming the first protected or escaping path."""
    root = worktree.resolve()
    for ch in changes:
        for repo_path in filter(None, (ch.path, ch.old_path)):
            _check_one(root, workspace_rel, repo_path, patterns, ch)


def _relative_forms(repo_path: str, workspace_rel: Path) -> list[str]:
    forms = [repo_path]
    ws = str(PurePosixPath(workspace_rel))
    if ws not in (".", "") and (repo_path == ws or repo_path.startswith(ws + "/")):
        forms.append(repo_path[len(ws) + 1:] if repo_path != ws else ".")
    return forms


def _check_one(root: Path, workspace_rel: Path, repo_path: str, patterns: list[str], ch: ChangedPath) -> None:
    verb = {"R": "renames", "C": "copies", "D": "deletes", "A": "adds"}.get(ch.status, "changes")
    for form in _relative_forms(repo_path, workspace_rel):
        hit = matches(form, patterns)
        if hit:
            raise PatchRejected(f"the diff {verb} {repo_path}, a protected path (pattern {hit!r}); "
                                "tests, criteria, benchmark harness and the workspace file may not be changed")
    full = root / repo_path
    # Resolve what the path really is: a link out of the tree, or onto a protected file.
    resolved = Path(os.path.realpath(full))
    if resolved != root and root not in resolved.parents:
        raise PatchRejected(f"{repo_path} resolves to {resolved}, outside the worktree")
    rel = resolved.relative_to(root).as_posix()
    for form in _relative_forms(rel, workspace_rel):
        hit = matches(form, patterns)
        if hit:
            raise PatchRejected(f"{repo_path} resolves to {rel}, a protected path (pattern {hit!r})")
    if full.is_symlink():
        target = os.readlink(full)
        dest = Path(os.path.realpath(full.parent / target)) if not os.path.isabs(target) else Path(target)
        if dest != root and root not in dest.parents:
            raise PatchRejected(f"the diff makes {repo_path} a symlink to {target}, outside the worktree")


def check_judge_files(workspace_rel: Path, changes: list[ChangedPath], judge_files: dict[str, str]) -> None:
    """Raise ``PatchRejected`` for a change to a file a kernel check's verdict runs
    (``judge_files``: workspace-relative path -> the check; ``infra_agent.lab.judge_files``)."""
    for ch in changes:
        for repo_path in filter(None, (ch.path, ch.old_path)):
            for form in _relative_forms(repo_path, workspace_rel):
                if form in judge_files:
                    raise PatchRejected(
                        f"the diff changes {repo_path}, which the reference or input factory of kernel check "
                        f"{judge_files[form]!r} runs; the judge's code may not change (change the kernel, "
                        "not what it is checked against)")
