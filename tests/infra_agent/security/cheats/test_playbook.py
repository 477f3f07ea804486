"""Cheat family: editing the playbook the run uses, when it lies inside the workspace (issue #37).

A run given ``--playbook FILE`` inside the workspace reads it once, before any worktree
exists; a diff that rewrites it changes nothing in that run, but, accepted, it would
change what every later run on the workspace is told to try.  While a run uses it, the
playbook is one of the run's protected paths (``agent/run_files.py``): the model's
``propose_diff`` is refused, and so is the experiment if the diff reached the executor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.ledger import Ledger
from infra_agent.standin.server import received_requests, serve_standin

from ...agent.loop_workspace import git
from .cheat_loop import Cheat, new_file, script
from .kernel_workspace import COMPONENT, kernel_workspace, replace_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PLAYBOOK = "playbooks/tuning.yaml"
RULES = "rules: []\n"
EDITED = "rules: []\n# every rule removed: nothing is ever proposed against this gate\n"


def test_the_playbook_inside_the_workspace_is_protected(tmp_path: Path) -> None:
    root = kernel_workspace(tmp_path / "ws")
    (root / "playbooks").mkdir()
    (root / PLAYBOOK).write_text(RULES)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "a playbook inside the workspace")
    head = git(root, "rev-parse", "HEAD").strip()
    cheats = [Cheat("rewrite the playbook", "failed_checks", component=COMPONENT,
                    diff=replace_file(PLAYBOOK, RULES, EDITED)),
              # Beside it, a file the run does not read: the protection is the playbook's, not the folder's.
              Cheat("add a note", "failed_checks", component=COMPONENT, diff=new_file("playbooks/NOTES.md", "notes\n"))]
    with serve_standin(script(cheats)) as url:
        run = start_run(root, RunOptions(proposer="llm", model="standin", base_url=url, budget_runs=len(cheats),
                                         confirm=False, top_up=False, look_again=False, playbook=str(root / PLAYBOOK)),
                        progress=False)
        sent = received_requests(url)
    messages = sent[-1].get("messages") or [] if sent else []
    results = [str(m.get("content", "")) for m in messages if m.get("role") == "tool"]
    refused = [r for r in results if PLAYBOOK in r and "protected" in r]
    assert refused, results
    # The other file was not refused for being protected.
    assert not [r for r in results if "playbooks/NOTES.md" in r and "protected" in r], results
    with Ledger.for_workspace(root) as ledger:
        exps = [e for e in ledger.experiments(run.id) if e.role == "experiment"]
    assert not any(e.accepted for e in exps if PLAYBOOK in (e.change.diff or "")), [(e.id, e.status) for e in exps]
    assert (root / PLAYBOOK).read_text() == RULES
    assert git(root, "log", "--format=%H", f"{head}..HEAD", "--", PLAYBOOK).strip() == ""


def test_a_relative_playbook_is_recorded_as_the_file_it_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--playbook tuning.yaml`` given from inside ``playbooks/``: the run records the file's absolute
    path, so a ``resume`` from any other directory reads and protects that file, not one of the same
    name under its own working directory (the path used to be recorded as given)."""
    root = kernel_workspace(tmp_path / "ws")
    (root / "playbooks").mkdir()
    (root / PLAYBOOK).write_text(RULES)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "a playbook inside the workspace")
    monkeypatch.chdir(root / "playbooks")
    run = start_run(root, RunOptions(proposer="rules", playbook="tuning.yaml", budget_runs=1, confirm=False,
                                     top_up=False, look_again=False), progress=False)
    assert run.options["playbook"] == str((root / PLAYBOOK).resolve()), run.options
    monkeypatch.chdir(tmp_path)
    from infra_agent.agent.runner import preflight
    from infra_agent.workspace import load_workspace

    ws = load_workspace(root)
    recorded = RunOptions.model_validate({k: v for k, v in run.options.items() if k in RunOptions.model_fields})
    preflight(ws, recorded)  # what `resume` does first, from another directory
    assert PLAYBOOK in ws.protected, ws.protected
