"""The code a ``run_probe`` call measures: the workspace as it is, or an experiment's, in a worktree.

An experiment's code is what it ran with: its accepted commit, or else its parent's commit
with its diff applied (a change the judge did not accept is still measurable), and its knob
values.  The worktree is the session's own (under ``.infra-agent/worktrees/mcp-<session>/``,
on a branch of its own), made for the call and removed after it, so the user's tree and the
run's branch are never touched; what the probe writes stays in the session's job folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra_agent.errors import InfraAgentError

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession
    from infra_agent.records import Experiment


@dataclass
class ProbeCode:
    """Where a probe's worker loads the workspace from, the knob values it starts from, and what to say of it."""

    workspace_file: Path
    label: str
    knobs: dict[str, Any] = field(default_factory=dict)
    experiment: str | None = None
    commit: str | None = None
    worktree: str | None = None  # the session worktree to remove after the call


def worktrees(session: McpSession) -> Any:
    """The session's worktrees (``Worktrees`` of the executor, under a run id of the session's own)."""
    from infra_agent.agent.executors.worktree import Worktrees

    return Worktrees(session.ws.root, session.marker_run)


def workspace_code(session: McpSession) -> ProbeCode:
    source = session.ws.source or (session.ws.root / "infra-agent.yaml")
    return ProbeCode(workspace_file=Path(source), label="the workspace as it is", knobs=session.best_knobs())


def experiment_code(session: McpSession, exp: Experiment, name: str) -> ProbeCode:
    """A worktree named ``name`` holding ``exp``'s code; InfraAgentError when it cannot be made
    (no git repository, a commit that is gone, a diff that no longer applies)."""
    from infra_agent.agent.runner import _exclude_from_git

    diff = exp.change.diff if exp.change.diff and exp.change.diff.strip() else None
    commit = exp.commit or exp.base_commit
    if commit is None and diff is None:
        code = workspace_code(session)
        code.knobs, code.experiment = dict(exp.knobs), exp.id
        code.label = f"{exp.id}'s knob values on the workspace as it is (the ledger holds no commit of its code)"
        return code
    wt = worktrees(session)
    _exclude_from_git(session.ws.root)  # the worktree lives in the workspace's .infra-agent folder
    start = commit or wt.head()
    path = wt.create(name, start)
    try:
        if exp.commit:
            label = f"{exp.id}'s commit {exp.commit[:12]} ({'accepted' if exp.accepted else 'its code'})"
        elif diff is not None:
            wt.apply(path, diff)
            label = f"{exp.id}'s diff on its parent's commit {start[:12]}"
        else:
            label = f"{exp.id}'s commit {start[:12]} (the code it ran; its change is knobs only)"
    except InfraAgentError:
        wt.remove(name)
        raise
    source = session.ws.source or (session.ws.root / "infra-agent.yaml")
    return ProbeCode(workspace_file=wt.workspace_in(path) / Path(source).name, label=label, knobs=dict(exp.knobs),
                     experiment=exp.id, commit=start, worktree=name)


def release(session: McpSession, code: ProbeCode) -> None:
    """Remove the call's worktree (quiet when there is none)."""
    if code.worktree is not None:
        try:
            worktrees(session).remove(code.worktree)
        except InfraAgentError:
            pass


def remove_all(session: McpSession) -> bool:
    """Every worktree the session's probes left (a killed call); True when there were some."""
    base = session.ws.root / ".infra-agent" / "worktrees" / session.marker_run
    if not base.exists():
        return False
    left = any(base.iterdir())  # each call removes its own: only a killed one leaves any
    try:
        worktrees(session).remove_all()
    except InfraAgentError:
        pass
    return left


__all__ = ["ProbeCode", "experiment_code", "release", "remove_all", "workspace_code", "worktrees"]
