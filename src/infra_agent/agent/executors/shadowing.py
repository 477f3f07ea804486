"""Shadowing: a change may not replace a module the harness imports (a reward-hacking guard).

A candidate that adds ``refstack/__init__.py`` next to a kernel spec, a ``.pth`` file or
a ``sitecustomize.py`` can rewrite the reference, the comparison or the clock in every
process that later puts that folder on ``sys.path``, without touching a protected file.
A list of protected names cannot keep up with that, so the rule follows the import
system instead:

- ``*.pth``, ``sitecustomize.py`` and ``usercustomize.py`` run at interpreter start when
  they sit on a path; a change may not add them anywhere.
- Every folder above an added Python file could be a ``sys.path`` entry (a spec folder
  is one); from there the file, or the folder below that holds it, imports under a
  top-level name.  When that name is importable in the harness's own environment (the
  standard library, an installed package) and the tree did not already hold that entry
  at that place, the change would shadow it: refused.  Folders that were packages before
  the change are skipped (a module inside ``src/refstack/`` imports as
  ``refstack.x``, never as ``x``); a package made by the change itself is not.
- A knob the candidate changes may not set ``PYTHONPATH``, ``PYTHONSTARTUP`` or
  ``PYTHONHOME`` for the target or a check: through the target's ``env``, a check's
  ``env``, or a value that spells the assignment out (``env PYTHONPATH=... cmd``).

Checked after ``git apply``, on what the diff did, like ``protect.check_changes``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from infra_agent.agent.executors.worktree import ChangedPath, PatchRejected, git
from infra_agent.workspace import template
from infra_agent.workspace.knobs import render_value
from infra_agent.workspace.models import ServerTargetSpec, Workspace

STARTUP_FILES = frozenset({"sitecustomize.py", "usercustomize.py"})
STARTUP_ENV = ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")
# Longest first, so "x.cpython-311-x86_64-linux-gnu.so" loses its whole suffix.
_SUFFIXES = sorted(importlib.machinery.all_suffixes(), key=len, reverse=True)


def harness_importable(name: str) -> bool:
    """Whether ``import name`` succeeds in this process's environment (without importing it)."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names or name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _module_name(filename: str) -> str | None:
    for suffix in _SUFFIXES:
        if filename.endswith(suffix) and len(filename) > len(suffix):
            stem = filename[: -len(suffix)]
            return stem if stem.isidentifier() else None
    return None


def _added(changes: list[ChangedPath]) -> list[str]:
    """Paths that exist only after the change: added, or the target of a rename or copy."""
    return [ch.path for ch in changes if ch.status in ("A", "R", "C")]


def check_shadowing(worktree: Path, changes: list[ChangedPath],
                    importable: Callable[[str], bool] = harness_importable) -> None:
    """Raise ``PatchRejected`` naming the first added path that would shadow an importable module."""
    added = _added(changes)
    new = set(added)
    held: dict[str, bool] = {}

    def existed(entry: str) -> bool:  # in the commit the change was applied to
        if entry not in held:
            held[entry] = bool(git(worktree, "ls-tree", "--name-only", "HEAD", "--", entry, check=False).strip())
        return held[entry]

    for path in added:
        parts = PurePosixPath(path).parts
        leaf = parts[-1]
        if leaf.endswith(".pth") or leaf in STARTUP_FILES:
            raise PatchRejected(f"the diff adds {path}: Python runs a {leaf if leaf in STARTUP_FILES else '.pth file'} "
                                "at interpreter start, before the harness's own code; a change may not add one")
        leaf_module = _module_name(leaf)
        if leaf_module is None:
            continue  # not importable itself; a folder of such files shadows nothing
        for depth in range(len(parts) - 1, -1, -1):
            folder = "/".join(parts[:depth])
            init = f"{folder}/__init__.py" if folder else "__init__.py"
            if folder and init not in new and (worktree / init).is_file():
                break  # a package before the change: what is below imports under its name
            name = leaf_module if depth == len(parts) - 1 else parts[depth]
            if name == "__init__":
                continue  # the package's own file: its folder's name is checked one level up
            entry = "/".join(parts[: depth + 1])
            if name.isidentifier() and importable(name) and not existed(entry):
                where = f"{folder}/" if folder else "the repository root"
                raise PatchRejected(f"the diff adds {path}, which would shadow the module {name!r} the harness imports "
                                    f"for any process with {where} on sys.path; a change may not add a module or "
                                    "package under the name of an importable one")


def check_knob_env(ws: Workspace, candidate: Mapping[str, Any], baseline: Mapping[str, Any]) -> None:
    """Raise ``PatchRejected`` when a knob the candidate changes sets a Python startup variable."""
    # Resolved, so a knob left at its default on one side and spelled out on the other is not a change.
    cand, base = ws.resolve_knobs(candidate), ws.resolve_knobs(baseline)
    changed = {k for k, v in cand.items() if base.get(k) != v}
    for knob in sorted(changed):
        value = render_value(cand[knob])
        for var in STARTUP_ENV:
            if f"{var}=" in value:
                raise PatchRejected(f"knob {knob!r} = {value!r} sets {var} for the candidate; a change may not "
                                    "choose what Python imports before the harness's code")
    envs: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(ws.target, ServerTargetSpec):
        envs.append(("target.env", ws.target.env))
    envs += [(f"checks.{c.name}.config.env", c.config.get("env") or {}) for c in ws.checks
             if isinstance(c.config.get("env"), Mapping)]
    for where, env in envs:
        for var in STARTUP_ENV:
            text = env.get(var)
            if not isinstance(text, str):
                continue
            try:
                used = set(template.placeholders(text)) & changed
            except ValueError:
                continue
            if used:
                knob = min(used)
                raise PatchRejected(f"knob {knob!r} sets {var} through {where}; a change may not choose what Python "
                                    "imports for the candidate")
