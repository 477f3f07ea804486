"""The base install: benchmarking a URL needs none of torch, fastapi, uvicorn, mcp, ray.

Each command runs in a fresh interpreter whose imports of those packages fail, as
they would where only ``pip install infra-agent`` ran: a ``sitecustomize`` on
``PYTHONPATH`` puts a finder first on ``sys.meta_path`` that raises
``ModuleNotFoundError`` for them (inherited by every subprocess: the loop's probe
workers too).  The servers under test are real refstack servers started outside
that interpreter, as a vLLM server would be.  A verb that needs an extra says in
one line which one, and exits 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

BLOCKED = ("torch", "triton", "fastapi", "uvicorn", "starlette", "mcp", "ray")

_SITECUSTOMIZE = '''
import os, sys
_BLOCKED = set(os.environ["INFRA_AGENT_TEST_BLOCK"].split(","))

class _NotInstalled:
    """Stands for a base install: these packages are absent."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


@pytest.fixture(scope="module")
def base_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("base-install")
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "INFRA_AGENT_TEST_BLOCK": ",".join(BLOCKED), "COLUMNS": "200"}


def _cli(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "infra_agent.cli.main", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout, check=False)


def test_the_blocker_blocks(base_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=base_env, check=False)
    assert proc.returncode == 1 and "No module named 'torch'" in proc.stderr


def _url_workspace(root: Path, url: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    spec = {"name": "url-only", "target": {"kind": "endpoint", "url": url, "metrics_url": "/metrics"},
            "scenarios": {"chat": {"dataset": {"kind": "random", "input_len": 16, "output_len": 8, "seed": 0},
                                   "endpoint": "chat", "num_requests": 6, "max_concurrency": 3, "warmup_requests": 0}},
            "criteria": [{"name": "tput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 1.0}]}
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root


@pytest.mark.slow
def test_url_benchmarking_works_without_the_extras(base_env: dict[str, str], refstack_server: Any, tmp_path: Path) -> None:
    url = refstack_server.url
    for verb in ("bench", "compare", "validate", "run", "trace", "ls", "report"):
        proc = _cli(base_env, verb, "--help")
        assert proc.returncode == 0, (verb, proc.stderr[-2000:])
    ws = _url_workspace(tmp_path / "ws", url)
    proc = _cli(base_env, "validate", str(ws), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        proc = _cli(base_env, "bench", url, "--num-requests", "4", "--max-concurrency", "2", "--input-len", "16",
                    "--output-len", "8", "--warmup-requests", "0", "--no-progress", "-o", str(out))
        assert proc.returncode == 0, proc.stderr[-2000:]
        results.append(json.loads(out.read_text()))
    assert all(r["completed"] == 4 and r["output_throughput"] > 0 for r in results)
    proc = _cli(base_env, "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "output_throughput" in proc.stdout
    # The loop on a URL target: the baseline is measured by a probe worker (a subprocess, blocked too).
    proc = _cli(base_env, "run", str(ws), "--budget-runs", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)
    assert run["gates_before"] and run["gates_before"][0]["outcome"] == "pass", run
    assert Path(run["report"]["html"]).is_file()


@pytest.mark.parametrize(("args", "needs", "extra"), [
    (("kernel", "check", "spec.py"), "torch", "kernels"),
    (("mcp",), "mcp", "mcp"),
    (("standin", "--script", "script.yaml"), "fastapi, uvicorn", "standin"),
    (("demo",), "torch, fastapi, uvicorn", "refstack"),
])
def test_a_verb_without_its_extra_names_the_extra(base_env: dict[str, str], tmp_path: Path, args: tuple[str, ...],
                                                  needs: str, extra: str) -> None:
    proc = _cli(base_env, *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    verb = "are" if "," in needs else "is"
    expected = f"error: infra-agent {args[0]} needs {needs}, which {verb} not installed: pip install 'infra-agent[{extra}]'"
    assert proc.stderr.strip().splitlines() == [expected]
    assert proc.stdout == "" and not list(tmp_path.iterdir())  # nothing was built or started
    # --json: one JSON object on stdout; --help still works without the extra.
    if args[0] in ("kernel", "demo"):
        proc = _cli(base_env, *args, "--json", cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and json.loads(proc.stdout)["message"].endswith(f"'infra-agent[{extra}]'")
    assert _cli(base_env, args[0], "--help", timeout=120).returncode == 0


def test_ray_executor_without_ray_names_the_extra(base_env: dict[str, str], tmp_path: Path) -> None:
    ws = _url_workspace(tmp_path / "ws", "http://127.0.0.1:9")
    proc = _cli(base_env, "run", str(ws), "--executor", "ray", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --executor ray needs Ray, which is not installed: pip install 'infra-agent[ray]'"]
    assert not (ws / ".infra-agent").exists()  # no run was recorded


def test_refstack_without_its_extra_names_the_extra(base_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny", "--port", "0"],
                          capture_output=True, text=True, env=base_env, timeout=120, check=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("refstack: error: refstack needs ") and line.endswith("pip install 'infra-agent[refstack]'")


def test_a_refstack_target_without_its_extra_names_the_extra(base_env: dict[str, str], tmp_path: Path) -> None:
    # `run` and `bench` on a workspace whose target is `refstack serve`: one line naming
    # the extra and exit 2 (a user error), not a baseline whose server dies before it is
    # ready (exit 1).
    import shutil

    ws = tmp_path / "ws"
    shutil.copytree(Path(__file__).resolve().parents[2] / "examples" / "refstack-serving", ws)
    expected = "target.command runs refstack, which needs torch, fastapi, uvicorn; they are not installed here: " \
               "pip install 'infra-agent[refstack]'"
    # This installation's console scripts on PATH, as in an activated environment.
    env = {**base_env, "PATH": os.pathsep.join([str(Path(sys.executable).parent), base_env.get("PATH", "")])}
    for args in (("run", str(ws), "--budget-runs", "1"), ("bench", str(ws), "--no-progress")):
        proc = _cli(env, *args, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines() == [f"error: {ws / 'infra-agent.yaml'}: {expected}"], proc.stderr
    assert not (ws / ".infra-agent" / "ledger.db").exists()  # no run was recorded
