"""Files the workspace file points at: what its criteria depend on besides itself.

A scenario's JSONL dataset, a kernel spec, a prompt set a check reads: a change that
edits one of them changes the measurement, not the system, so they are protected like
``infra-agent.yaml`` is.  Found from the loaded workspace: every dataset path, and every
check config string (without a ``{knob}`` placeholder) that names a file inside the
workspace folder (a command check's ``command``, which may be the code under test, is
not taken).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infra_agent.workspace.models import Workspace


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def referenced_files(ws: Workspace) -> list[str]:
    """Posix paths, relative to the workspace folder, of the files the workspace file references."""
    root = ws.root.resolve()
    found: list[Path] = []
    for scenario in ws.scenarios.values():
        path = getattr(scenario.dataset, "path", None)
        if isinstance(path, Path):
            found.append(path if path.is_absolute() else root / path)
    for check in ws.checks:
        # A command check's program may be the code under test itself; what it reads is not.
        config = {k: v for k, v in check.config.items() if not (check.probe == "command" and k == "command")}
        for text in _strings(config):
            if "{" in text or "\n" in text or not text.strip() or len(text) > 500:
                continue  # a template, or text that is not a path
            try:
                candidate = root / text
                if candidate.is_file():
                    found.append(candidate)
            except (OSError, ValueError):
                continue
    out: list[str] = []
    for path in found:
        try:
            rel = path.resolve().relative_to(root).as_posix()
        except (OSError, ValueError):
            continue  # outside the workspace: no change in it can touch the file
        # A glob character in a name would make the pattern mean more than the file.
        if not any(c in rel for c in "*?[") and rel not in out:
            out.append(rel)
    return out
