"""Moving a workspace folder to the node that runs an experiment, and its artifacts back.

Nodes of a cluster share no file system, so each side of an experiment travels as a
gzipped tar of its workspace folder as the driver prepared it: the user's tree for a
knob change, a git worktree with the diff applied for a code change.  ``.git``,
``.infra-agent`` (the ledger, logs and worktrees) and ``__pycache__`` stay behind.
Files outside the workspace folder (an absolute path in the launch command, an
installed program) must exist on every node.

Artifacts a probe wrote on the node (a kernel report, a server log, a trace) come
back as bytes, up to a cap, and are written under the driver's run folder, so the
report's links work; a larger one is named with the node it stayed on.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

from infra_agent.errors import InfraAgentError

_SKIP_DIRS = {".git", ".infra-agent", "__pycache__"}
MAX_SHIP_BYTES = 256 << 20  # a workspace folder larger than this is a mistake (a model or a venv inside it)
MAX_ARTIFACT_BYTES = 8 << 20  # per file brought back
MAX_ARTIFACTS_TOTAL = 64 << 20  # per task


def _skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    parts = Path(info.name).parts
    return None if any(p in _SKIP_DIRS for p in parts) else info


def pack(folder: Path) -> bytes:
    """The workspace folder as a gzipped tar (paths relative to it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for child in sorted(folder.iterdir()):
            if child.name in _SKIP_DIRS:
                continue
            tar.add(child, arcname=child.name, filter=_skip)
    data = buf.getvalue()
    if len(data) > MAX_SHIP_BYTES:
        raise InfraAgentError(f"the workspace folder {folder} is {len(data) >> 20} MiB packed, more than the "
                              f"{MAX_SHIP_BYTES >> 20} MiB a Ray task carries: keep large files (weights, "
                              "environments) outside it, at a path every node has")
    return data


def unpack(data: bytes, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        if hasattr(tarfile, "tar_filter"):
            tar.extractall(dest, filter="tar")  # no absolute paths, no '..' (Python's own checks)
        else:  # Python before 3.10.12 has no extraction filters: the same checks by hand
            root = dest.resolve()
            for member in tar.getmembers():
                if not (dest / member.name).resolve().is_relative_to(root):
                    raise InfraAgentError(f"a shipped workspace holds a path outside itself: {member.name}")
            tar.extractall(dest)
    return dest


def collect_artifacts(feedbacks: list[dict[str, Any]], under: Path) -> dict[str, bytes]:
    """Read the artifact files written under ``under`` (the task's folder), within the caps."""
    out: dict[str, bytes] = {}
    total = 0
    base = under.resolve()
    for fb in feedbacks:
        for art in fb.get("artifacts") or []:
            path = Path(str(art.get("path", ""))).resolve()
            if not path.is_file() or base not in path.parents or str(path) in out:
                continue
            size = path.stat().st_size
            if size > MAX_ARTIFACT_BYTES or total + size > MAX_ARTIFACTS_TOTAL:
                continue
            out[str(path)] = path.read_bytes()
            total += size
    return out


def restore_artifacts(feedbacks: list[dict[str, Any]], files: dict[str, bytes], node_root: str, dest: Path,
                      node: str) -> None:
    """Write what came back under ``dest`` and point the Feedbacks at it; the rest name their node."""
    for fb in feedbacks:
        for art in fb.get("artifacts") or []:
            path = str(art.get("path", ""))
            if path in files:
                rel = Path(path).relative_to(node_root) if path.startswith(node_root) else Path(Path(path).name)
                local = dest / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(files[path])
                art["path"] = str(local)
            elif path.startswith(node_root):
                art["description"] = (art.get("description") or "") + f" (left on node {node}: too large to bring back, " \
                                                                       "or removed with the task's folder)"
