"""A small workspace with code of its own, for tests of the loop on a real refstack.

``serve.py`` launches ``refstack serve`` with the step delay that ``tuning.py``
declares, so a diff to ``tuning.py`` is a real code change with a measurable effect
(a 30 ms step becomes a 3 ms one), and the workspace is a git repository the executor
can make worktrees of.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import yaml

SERVE = '''\
"""Launch refstack with this workspace's tuning (the code under test)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tuning  # noqa: E402

os.execv(sys.executable, [sys.executable, "-m", "refstack.cli", "serve", "--preset", "tiny", "--host", "127.0.0.1",
                          "--log-level", "warning", *sys.argv[1:], "--step-delay-ms", str(tuning.STEP_DELAY_MS)])
'''

FAST_DIFF = '''\
--- a/tuning.py
+++ b/tuning.py
@@ -1,2 +1,2 @@
 # The engine step's fixed cost, in milliseconds.
-STEP_DELAY_MS = 30
+STEP_DELAY_MS = 3
'''

PROTECTED_DIFF = '''\
--- a/tests/test_tuning.py
+++ b/tests/test_tuning.py
@@ -1,2 +1,2 @@
 def test_tuning():
-    assert True
+    assert 1
'''


def make_workspace(root: Path, *, criteria: list[dict[str, Any]] | None = None, checks: list[dict[str, Any]] | None = None,
                   extra_knobs: dict[str, Any] | None = None, command: list[str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "serve.py").write_text(SERVE)
    (root / "tuning.py").write_text("# The engine step's fixed cost, in milliseconds.\nSTEP_DELAY_MS = 30\n")
    (root / "tests").mkdir(exist_ok=True)
    (root / "tests" / "test_tuning.py").write_text("def test_tuning():\n    assert True\n")
    (root / ".gitignore").write_text(".infra-agent/\n")
    knobs: dict[str, Any] = {
        "max_running": {"type": "int", "min": 1, "max": 64, "default": 4, "components": ["engine.scheduler"],
                        "help": "Most requests running at once."},
    }
    knobs.update(extra_knobs or {})
    spec = {
        "name": "loop-test",
        "target": {"kind": "server", "command": command or [sys.executable, "serve.py", "--port", "{port}", "--max-running", "{max_running}"],
                   "ready_url": "/health", "metrics_url": "/metrics", "ready_timeout_s": 120, "stop_grace_s": 5},
        "knobs": knobs,
        "scenarios": {"chat": {"dataset": {"kind": "random", "input_len": 16, "output_len": 8, "seed": 0},
                               "endpoint": "chat", "num_requests": 8, "max_concurrency": 4, "warmup_requests": 1}},
        # 8 tokens per request, 4 at a time: a 30 ms step gives ~100 tok/s, a 3 ms one several hundred.
        "criteria": criteria if criteria is not None else
        [{"name": "chat-throughput", "metric": "output_throughput", "scenario": "chat", "op": ">=", "value": 1e6}],
        "checks": checks or [],
    }
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root


def git(root: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost", "PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(root)}
    return subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True, text=True).stdout


def llm_script(diff: str = FAST_DIFF, *, min_effect: float = 0.2) -> dict[str, Any]:
    """Read the code, change the step cost, test the claim, finish."""
    return {"turns": [
        {"tool_calls": [{"tool": "read_file", "arguments": {"path": "tuning.py"}}]},
        {"tool_calls": [{"tool": "propose_diff", "arguments": {"diff": diff}}]},
        {"tool_calls": [{"tool": "run_experiment", "arguments": {
            "statement": "The engine's fixed step cost dominates decode: cutting it from 30 to 3 ms raises output throughput",
            "metric": "output_throughput", "direction": "higher", "min_effect": min_effect, "scenario": "chat",
            "locality": {"component": "engine.loop"}}}]},
        {"tool_calls": [{"tool": "finish", "arguments": {"reason": "the claim was tested"}}]},
    ], "on_exhausted": "finish"}


def dedent(text: str) -> str:
    return textwrap.dedent(text)
