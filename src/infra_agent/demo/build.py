"""Build the demo workspace: a git repository whose ``infra-agent.yaml`` comes from
refstack's own knob listing, plus the case-study kernel spec.

The demo reaches refstack only through its command line (``refstack knobs --json``,
``refstack serve``), exactly as it would reach any other serving stack.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from infra_agent.workspace.discover import read_knob_listing, workspace_knobs

# The demo's workload: 8 concurrent chats.  Its engine step is pinned to at least
# STEP_DELAY_MS (the calibration knob), so the demo's numbers do not depend on how
# fast the machine is: the criteria below fail at the mis-set baseline and pass once
# the scheduler admits the whole batch, on a busy 2-core box and on a GPU host alike.
STEP_DELAY_MS = 20
DEMO_SCENARIOS: dict[str, Any] = {
    "chat": {
        "dataset": {"kind": "random", "input_len": 32, "output_len": 16, "range_ratio": 0.25, "seed": 0},
        "endpoint": "chat",
        "num_requests": 16,
        "max_concurrency": 8,
        "request_rate": "inf",
        "warmup_requests": 2,
        "slo": {"ttft_ms": 3000, "tpot_ms": 300},
    },
}
# Absolute gates on the chat workload (STEP_DELAY_MS makes them portable): at
# max_running=2 a batch of 8 queues, TTFT grows with the queue and throughput is
# capped near 2 tokens per step: at most 100 tok/s with steps of >= 20 ms, on any machine.
# The fixed batch of 8 reads 140-200 tok/s on a 2-core box loaded by the test suite (a
# confirmation there read 166 [144, 192]), so the throughput bar sits 25% above the
# baseline's cap, not near the loaded fix (150 left that confirmation undecided).
DEMO_CRITERIA: list[dict[str, Any]] = [
    {"name": "chat-throughput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 125},
    {"name": "chat-p90-ttft", "metric": "p90_ttft_ms", "scenario": "chat", "op": "<=", "value": 400},
]
# The mis-set baseline: a batch cap far below the workload's concurrency, and a tf32 LM
# head (fast, but tensor-parallel shards no longer agree with the unpartitioned GEMM).
DEMO_DEFAULTS: dict[str, Any] = {"max_running": 2, "lm_head_precision": "tf32"}


def refstack_command() -> list[str]:
    """How to invoke refstack: the console script when installed, else this Python."""
    exe = shutil.which("refstack")
    return [exe] if exe else [sys.executable, "-m", "refstack.cli"]


def find_examples_dir() -> Path | None:
    """The repository's ``examples/`` folder (source checkouts and editable installs)."""
    env = os.environ.get("INFRA_AGENT_EXAMPLES")
    candidates = [Path(env)] if env else []
    candidates += [p / "examples" for p in Path(__file__).resolve().parents] + [Path.cwd() / "examples"]
    for cand in candidates:
        if (cand / "tp-numerics" / "spec.py").is_file():
            return cand
    return None


def build_demo_workspace(workdir: Path) -> Path:
    """Write (or refresh) the demo workspace in ``workdir`` and commit it; returns the yaml path."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = refstack_command()
    listing = read_knob_listing([*cmd, "knobs", "--json"])
    # The preset is fixed (tiny: fast on a CPU); trace, trace_level and log_level change
    # observability, not performance, so they are pinned too.  The calibration knobs
    # (step_delay_ms, step_slowdown) stay knobs: benchmarks of the judge use them.
    knobs, flags = workspace_knobs(listing, fixed={"preset": "tiny", "trace": "false", "trace_level": "layer",
                                                   "log_level": "warning", "step_delay_ms": STEP_DELAY_MS})
    # The listing's search space comes with each knob (scale, typical range, resource: a
    # search on this workspace never runs more torch threads than the machine has cores).
    # The mis-set default stays outside max_running's typical range on purpose: it is the
    # baseline to fix, not a value a user would pick.
    for name, value in DEMO_DEFAULTS.items():
        knobs[name]["default"] = value
    missing = [k for k in ("max_running", "torch_threads") if not ({"typical", "resource"} & set(knobs.get(k, {})))]
    assert not missing, f"refstack's knob listing lost the search space of {missing}"
    examples = find_examples_dir()
    checks = []
    if examples is not None:
        # Case study A as a cheap gate: the LM head's TP shards must agree with the
        # unpartitioned kernel at the precision the server runs.
        checks.append({"name": "lm-head-tp-agreement", "probe": "kernel", "components": ["model.lm_head"],
                       "config": {"spec": "kernels/tp-numerics/spec.py", "spec_name": "kda_o_proj_to_lm_head", "mode": "check",
                                  "seeds": 1, "precisions": "{lm_head_precision}"}})
    spec = {
        "name": "refstack-demo",
        "target": {
            "kind": "server",
            "command": [*cmd, "serve", "--port", "{port}", *flags],
            "ready_url": "/health",
            "metrics_url": "/metrics",
            "ready_timeout_s": 120,
        },
        "knobs": knobs,
        "scenarios": DEMO_SCENARIOS,
        "criteria": DEMO_CRITERIA,
        "checks": checks,
    }
    yaml_path = workdir / "infra-agent.yaml"
    header = "# Generated by `infra-agent demo` from `refstack knobs --json`.\n"
    yaml_path.write_text(header + yaml.safe_dump(spec, sort_keys=False, width=100))
    if examples is not None:
        dest = workdir / "kernels" / "tp-numerics"
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("spec.py", "README.md"):
            if (examples / "tp-numerics" / name).is_file():
                shutil.copy2(examples / "tp-numerics" / name, dest / name)
    (workdir / ".gitignore").write_text(".infra-agent/\n")
    _git_commit(workdir)
    return yaml_path


def _git_commit(workdir: Path) -> None:
    """A workspace is a git repository: later steps apply patches in worktrees of it."""
    if shutil.which("git") is None:
        return
    env = dict(os.environ, GIT_AUTHOR_NAME="infra-agent", GIT_AUTHOR_EMAIL="infra-agent@localhost",
               GIT_COMMITTER_NAME="infra-agent", GIT_COMMITTER_EMAIL="infra-agent@localhost")
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], cwd=workdir, env=env, capture_output=True, text=True, check=False)
    if not (workdir / ".git").exists():
        git("init", "-q")
    git("add", "-A")
    if git("diff", "--cached", "--quiet").returncode != 0:
        git("commit", "-q", "-m", "infra-agent demo workspace")
