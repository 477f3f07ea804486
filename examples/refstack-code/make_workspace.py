"""Make the refstack-code workspace: a git repository holding refstack's source and this workspace file.

    python examples/refstack-code/make_workspace.py DEST [--source PATH] [--json]

The loop measures a code change by running the target from a git worktree that holds
the change, and its proposers read and edit code under the workspace folder only.  So
the code under test must live in the workspace's repository, below its folder: this
copies refstack's package (``--source``, by default the ``src/refstack`` of the checkout
this script sits in, else the installed package) to ``DEST/src/refstack``, puts
``infra-agent.yaml`` and ``README.md`` beside it, and commits the lot.  The target runs
``python -m refstack.cli`` with ``PYTHONPATH=src``, so the worktree's copy is the one
imported (docs/workspace.md, "Measuring code changes").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# What a run writes beside the code: the ledger and worktrees, and bytecode caches.
GITIGNORE = ".infra-agent/\n__pycache__/\n*.pyc\n"
_GIT_IDENTITY = ("-c", "user.name=infra-agent", "-c", "user.email=infra-agent@localhost")


class WorkspaceError(Exception):
    """The workspace cannot be made; the message names what and where."""


def refstack_source(source: Path | None = None) -> Path:
    """The refstack package folder to copy: ``source``, the checkout's, else the installed one."""
    candidates = [source] if source is not None else [HERE.parents[1] / "src" / "refstack"]
    if source is None:
        spec = importlib.util.find_spec("refstack")
        if spec is not None and spec.submodule_search_locations:
            candidates.append(Path(next(iter(spec.submodule_search_locations))))
    for path in candidates:
        if path is not None and (path / "__init__.py").is_file() and (path / "cli.py").is_file():
            return path.resolve()
    where = source if source is not None else "the checkout's src/refstack or an installed refstack"
    raise WorkspaceError(f"--source: expected refstack's package folder (with __init__.py and cli.py), got {where}")


def make_workspace(dest: Path, source: Path | None = None) -> Path:
    """``dest`` as a committed git repository: ``src/refstack`` (a copy of ``source``), the workspace file,
    the README and a ``.gitignore``.  Returns ``dest``."""
    package = refstack_source(source)
    if dest.exists() and any(dest.iterdir()):
        raise WorkspaceError(f"DEST: expected a new or empty folder, got {dest} (it holds files)")
    if shutil.which("git") is None:
        raise WorkspaceError("git: expected on PATH (the loop makes a worktree per code change), got none")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(package, dest / "src" / "refstack", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    for name in ("infra-agent.yaml", "README.md"):
        shutil.copy(HERE / name, dest / name)
    (dest / ".gitignore").write_text(GITIGNORE)
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", f"refstack from {package}"]):
        proc = subprocess.run(["git", *_GIT_IDENTITY, *args], cwd=dest, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise WorkspaceError(f"git {args[0]} in {dest} failed: {(proc.stderr or proc.stdout).strip()}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="the folder to create (new or empty)")
    parser.add_argument("--source", type=Path, default=None, help="refstack's package folder to copy")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        dest = make_workspace(args.dest, args.source)
    except WorkspaceError as exc:
        print(json.dumps({"error": str(exc)}) if args.json else f"error: {exc}", file=sys.stderr)
        return 2
    source = refstack_source(args.source)
    if args.json:
        print(json.dumps({"workspace": str(dest), "source": str(source)}))
    else:
        print(f"workspace {dest} (refstack from {source}); next: infra-agent validate {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
