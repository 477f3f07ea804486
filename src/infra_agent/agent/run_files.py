"""Files a run reads from the workspace besides the workspace file: protected like it.

The rules proposer reads its playbook (``--playbook FILE``) once, from the path given.
When that file lies inside the workspace, a diff that edits it could not change the run
that made it (the file was read before any worktree existed), but an accepted commit
would change what every later run on the workspace is told to try.  So while a run uses
a playbook inside the workspace, the playbook is a protected path of that run: the
executor refuses a diff that touches it, and the model is told so when it proposes one.
"""

from __future__ import annotations

from pathlib import Path

from infra_agent.workspace import Workspace


def protect_playbook(ws: Workspace, playbook: str | None) -> str | None:
    """Add ``playbook`` to the run's protected paths when it is inside ``ws``; its workspace-relative path, or None."""
    if not playbook:
        return None
    path = Path(playbook).expanduser()
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    try:
        rel = path.relative_to(Path(ws.root).resolve()).as_posix()
    except ValueError:
        return None  # outside the workspace: no diff of a candidate can reach it
    if rel not in ws.protected:
        ws.protected.append(rel)
    return rel
