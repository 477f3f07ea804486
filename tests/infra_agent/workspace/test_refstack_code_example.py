"""examples/refstack-code/make_workspace.py: a committed repository holding refstack's source and the workspace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra_agent.workspace import load_workspace

from ..probes.code_workspace import EXAMPLE, ROOT, git, make_workspace_module

SCRIPT = EXAMPLE / "make_workspace.py"


def test_the_workspace_holds_refstack_and_runs_it_from_src(tmp_path: Path) -> None:
    dest = make_workspace_module().make_workspace(tmp_path / "ws")
    assert (dest / "src" / "refstack" / "engine" / "engine.py").read_text() == \
        (ROOT / "src" / "refstack" / "engine" / "engine.py").read_text()
    assert not list((dest / "src").rglob("__pycache__"))
    # Everything is committed: a worktree of HEAD holds the code the target runs.
    assert git(dest, "status", "--porcelain") == "" and "src/refstack/cli.py" in git(dest, "ls-files")
    ws = load_workspace(dest)
    assert ws.target.env["PYTHONPATH"] == "src" and "refstack serve" in str(ws.target.command)  # type: ignore[union-attr]
    assert {"chat", "short-burst", "long-output"} <= set(ws.scenarios)
    # The goal fails on the baseline (a target ratio), so a run does not stop at once.
    goal = next(c for c in ws.criteria if c.name == "chat-throughput")
    assert goal.ratio is not None and goal.ratio > 1


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)


def test_json_and_refusals(tmp_path: Path) -> None:
    made = _run(str(tmp_path / "a"), "--json")
    assert made.returncode == 0, made.stderr
    out = json.loads(made.stdout)
    assert out["workspace"] == str(tmp_path / "a") and Path(out["source"]).name == "refstack"
    again = _run(str(tmp_path / "a"))
    assert again.returncode == 2 and "DEST: expected a new or empty folder" in again.stderr and "a" in again.stderr
    bad = _run(str(tmp_path / "b"), "--source", str(tmp_path), "--json")
    assert bad.returncode == 2 and "--source" in json.loads(bad.stderr)["error"]
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", ["infra-agent.yaml", "README.md"])
def test_the_example_files_are_copied(tmp_path: Path, name: str) -> None:
    dest = make_workspace_module().make_workspace(tmp_path / "ws")
    assert (dest / name).read_text() == (EXAMPLE / name).read_text()
