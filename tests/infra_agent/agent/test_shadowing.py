"""Shadowing is refused by import graph: checked in a real worktree, after the diff is applied."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.executors import shadowing
from infra_agent.agent.executors.worktree import PatchRejected, Worktrees
from infra_agent.workspace.loader import load_workspace

from .loop_workspace import git, make_workspace


def new_files(*paths: str) -> str:
    """A diff that only adds ``paths``, each holding one line of Python."""
    return "".join(f"--- /dev/null\n+++ b/{p}\n@@ -0,0 +1 @@\n+X = 1\n" for p in paths)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_workspace(tmp_path_factory.mktemp("shadow") / "ws")
    # A package of the workspace's own, and a spec folder beside it (as the demo has).
    (root / "src" / "mypkg").mkdir(parents=True)
    (root / "src" / "mypkg" / "__init__.py").write_text("")
    (root / "kernels" / "tp-numerics").mkdir(parents=True)
    (root / "kernels" / "tp-numerics" / "spec.py").write_text("SPEC = None\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "package and spec folder")
    return root


def _apply(repo: Path, diff: str) -> None:
    wt = Worktrees(repo, "rshadow")
    path = wt.create("x", wt.head())
    try:
        shadowing.check_shadowing(path, wt.apply(path, diff))
    finally:
        wt.remove_all()


def test_the_audits_reproducer_is_refused_naming_path_and_module(repo: Path) -> None:
    with pytest.raises(PatchRejected, match=r"kernels/tp-numerics/torch/__init__.py, which would shadow the module 'torch'"):
        _apply(repo, new_files("kernels/tp-numerics/torch/__init__.py"))


@pytest.mark.parametrize("path", ["json.py", "kernels/tp-numerics/pytest.py", "kernels/tp-numerics/yaml/__init__.py",
                                  "kernels/new/torch/nn.py"])
def test_a_module_or_package_under_an_importable_name_is_refused(repo: Path, path: str) -> None:
    with pytest.raises(PatchRejected, match="would shadow the module"):
        _apply(repo, new_files(path))


@pytest.mark.parametrize("path", ["kernels/tp-numerics/x.pth", "sitecustomize.py", "kernels/usercustomize.py"])
def test_startup_files_are_refused_anywhere(repo: Path, path: str) -> None:
    with pytest.raises(PatchRejected, match="interpreter start"):
        _apply(repo, new_files(path))


def test_making_a_folder_a_package_does_not_hide_what_it_holds(repo: Path) -> None:
    # The spec folder still goes on sys.path, __init__.py or not.
    with pytest.raises(PatchRejected, match="'torch'"):
        _apply(repo, new_files("kernels/tp-numerics/__init__.py", "kernels/tp-numerics/torch.py"))


@pytest.mark.parametrize("path", ["src/mypkg/json.py", "src/mypkg/sub/__init__.py", "kernels/tp-numerics/helpers.py",
                                  "src/newpkg/__init__.py"])
def test_modules_inside_an_existing_package_and_new_names_pass(repo: Path, path: str) -> None:
    _apply(repo, new_files(path))


def test_importable_is_the_harness_environment() -> None:
    assert shadowing.harness_importable("json") and shadowing.harness_importable("torch") and shadowing.harness_importable("infra_agent")
    assert not shadowing.harness_importable("no_such_module_for_infra_agent_tests")


def test_a_knob_that_sets_a_python_startup_variable_is_refused(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws", extra_knobs={
        "extra_path": {"type": "str", "default": "", "components": ["engine"]},
        "launcher_env": {"type": "str", "default": "X=1", "components": ["engine"]},
    })
    spec = (root / "infra-agent.yaml").read_text().replace("  stop_grace_s: 5\n", "  stop_grace_s: 5\n  env:\n    PYTHONPATH: '{extra_path}'\n")
    (root / "infra-agent.yaml").write_text(spec)
    ws = load_workspace(root)
    base = ws.resolve_knobs()
    with pytest.raises(PatchRejected, match=r"knob 'extra_path' sets PYTHONPATH through target.env"):
        shadowing.check_knob_env(ws, {**base, "extra_path": "/tmp/evil"}, base)
    with pytest.raises(PatchRejected, match=r"knob 'launcher_env' = 'PYTHONSTARTUP=/tmp/x.py' sets PYTHONSTARTUP"):
        shadowing.check_knob_env(ws, {**base, "launcher_env": "PYTHONSTARTUP=/tmp/x.py"}, base)
    # Unchanged, or a knob that does not reach the variable: allowed.
    shadowing.check_knob_env(ws, base, base)
    shadowing.check_knob_env(ws, {**base, "max_running": 8}, base)
