"""Which optional packages are importable here, without importing them.

A base install (``pip install infra-agent``) has none of refstack's, the kernel lab's or
the MCP server's packages.  The CLI asks before it starts anything, so a missing extra
is one line naming it (exit status 2), not a server that dies before it is ready or a
traceback from a worker.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

# What `refstack serve` imports (the `refstack` extra).
REFSTACK_MODULES = ("torch", "fastapi", "uvicorn")


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """The top-level modules among ``names`` that cannot be imported here (looked up, not imported)."""
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def _runs_our_refstack(command: str | list[str]) -> bool:
    """The launch command starts this installation's refstack (its console script, or
    ``python -m refstack...`` with this interpreter), not some other environment's."""
    try:
        argv = shlex.split(command) if isinstance(command, str) else list(command)
    except ValueError:
        return False
    if not argv:
        return False
    here = Path(sys.executable).parent
    if os.path.basename(argv[0]) == "refstack":
        found = shutil.which(argv[0])
        return found is not None and Path(found).parent == here
    if os.path.basename(argv[0]).startswith("python") and "-m" in argv:
        module = argv[argv.index("-m") + 1] if argv.index("-m") + 1 < len(argv) else ""
        found = shutil.which(argv[0])
        return module.split(".")[0] == "refstack" and found is not None and Path(found).parent == here
    return False


def target_needs(target: Any) -> str | None:
    """Why a workspace's target cannot start in this installation (a missing extra), or None."""
    if getattr(target, "kind", None) != "server" or not _runs_our_refstack(target.command):
        return None
    missing = missing_modules(REFSTACK_MODULES)
    if not missing:
        return None
    return (f"target.command runs refstack, which needs {', '.join(missing)}; "
            f"{'it is' if len(missing) == 1 else 'they are'} not installed here: pip install 'infra-agent[refstack]'")


__all__ = ["REFSTACK_MODULES", "missing_modules", "target_needs"]
