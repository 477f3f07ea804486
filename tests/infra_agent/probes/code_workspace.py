"""The refstack-code workspace for tests, and the code bottlenecks planted in it.

``code_workspace`` makes the workspace the way a user does
(``examples/refstack-code/make_workspace.py``: a git repository holding a copy of
refstack's source under ``src/`` and the workspace file), then points the server's
``PYTHONPATH`` at this checkout's ``src`` as well, after the workspace's own: the server
imports ``infra_agent.tracing`` from the code under test, as the test process does
(with an editable install of this checkout, as in CI, that is where it comes from
anyway).  refstack itself still comes from the workspace's copy, first on the path.

A ``Plant`` is one small edit of that copy: a stretch of refstack's source, replaced.
Each one stands for a code-level bottleneck a change could bring in.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra_agent.feedback import Feedback, Finding
from infra_agent.probes.base import ProbeContext
from infra_agent.probes.timeline import TimelineProbe
from infra_agent.workspace import load_workspace

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "refstack-code"


def make_workspace_module() -> Any:
    spec = importlib.util.spec_from_file_location("refstack_code_make_workspace", EXAMPLE / "make_workspace.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_workspace(dest: Path) -> Path:
    """The example workspace made in ``dest`` (committed), its server importing this checkout's tracing."""
    make_workspace_module().make_workspace(dest, ROOT / "src" / "refstack")
    path = dest / "infra-agent.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["target"]["env"]["PYTHONPATH"] = os.pathsep.join(["src", str(ROOT / "src")])
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=120))
    git(dest, "commit", "-qam", "the server imports this checkout's tracing")
    return dest


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}
    return subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True, text=True).stdout


@dataclass(frozen=True)
class Plant:
    """Edits of refstack's source: each ``(file, old, new)`` replaces the one occurrence of ``old``."""

    name: str
    edits: tuple[tuple[str, str, str], ...]

    def apply(self, ws: Path) -> None:
        for rel, old, new in self.edits:
            path = ws / rel
            text = path.read_text()
            found = text.count(old)
            assert found == 1, f"{self.name}: {rel} holds the planted stretch {found} times, expected once:\n{old}"
            path.write_text(text.replace(old, new))


ENGINE = "src/refstack/engine/engine.py"

def blocking_call(seconds: float) -> Plant:
    """A synchronous call of ``seconds`` on the event loop, in the handler of every request."""
    return Plant("a blocking call on the event loop", ((
        "src/refstack/server/openai_routes.py",
        '    tracing.instant("http.submit", cat="server", request_id=rs.request_id, path=request.url.path)\n',
        '    tracing.instant("http.submit", cat="server", request_id=rs.request_id, path=request.url.path)\n'
        f"    time.sleep({seconds})  # an audit call, made synchronously on the event loop\n"),))


# For the timeline's planted-bottleneck test: 20 ms a request was about 20% of a loaded
# machine's window (the whole machine slows, the sleeps do not), at the thread_blocked
# threshold; 50 ms keeps the loop blocked for well over it.
LONG_BLOCKING_CALL = blocking_call(0.05)

# The regression the loop and MCP tests fix: a check that holds the GIL on the event loop for
# each request (a backtracking pattern; ``re`` keeps the GIL while it matches), so the engine's
# thread stalls with the loop.  Its cost is CPU work and scales with the machine, as the
# engine's does: the fix's effect is about the same ratio on a fast box, a slow one or a
# loaded one.  A sleep would not do: it releases the GIL and only adds up to an effect where
# its 128 x 20 ms outlast the engine's own work (on one 2-core AVX2 box they did not: 1.04x).
AUDIT_CALL = "re.match(r'(a+)+b', 'a' * 19)"
AUDIT_CHECK = Plant("a GIL-holding check on the event loop", (
    ("src/refstack/server/openai_routes.py",
     '    tracing.instant("http.submit", cat="server", request_id=rs.request_id, path=request.url.path)\n',
     '    tracing.instant("http.submit", cat="server", request_id=rs.request_id, path=request.url.path)\n'
     f"    {AUDIT_CALL}  # an audit check of each request, made synchronously on the event loop\n"),
    ("src/refstack/server/openai_routes.py", "import time\n", "import re\nimport time\n"),
))

# The engine holds its inbox lock (made re-entrant) for its whole step, a step that opens with a
# short window for requests in flight to join it: the lock keeps exactly those requests out.
LOCK_HELD = Plant("a lock held across a long section", (
    (ENGINE, "        self._lock = threading.Lock()\n", "        self._lock = threading.RLock()\n"),
    (ENGINE,
     "            try:\n"
     "                self.step()\n",
     "            try:\n"
     "                with self._lock:  # the counts stay consistent for their readers while a step runs\n"
     "                    self.step()\n"),
    (ENGINE,
     "        with self._lock:\n"
     "            new, self._inbox = self._inbox, []\n",
     "        with self._lock:\n"
     "            time.sleep(0.003)  # a moment for requests in flight to join this step\n"
     "            new, self._inbox = self._inbox, []\n"),
))

PER_TOKEN_WORK = Plant("per-token work that grows with the output", ((
    "src/refstack/engine/deltas.py",
    "    checked = len(req.text)\n",
    "    checked = len(req.text)\n"
    "    # a repetition guard: the output's n-grams so far (n = 4 to 10), gathered again for every token\n"
    "    for n in range(4, 11):\n"
    "        grams = {tuple(req.output_ids[i:i + n]) for i in range(len(req.output_ids) - n + 1)}\n"
    "        if len(grams) < len(req.output_ids) // 64:\n"
    '            return "stop"\n'),))

SYNC_WRITE = Plant("a synchronous write per step", (
    (ENGINE,
     "            if self.config.step_delay_ms > 0:\n",
     "            self._journal(ready)\n"
     "            if self.config.step_delay_ms > 0:\n"),
    (ENGINE,
     "    def _on_admitted(self, req: Request) -> None:\n",
     "    def _journal(self, ready: list[tuple[ScheduledChunk, torch.Tensor]]) -> None:\n"
     "        # every row's logits on disk before the step ends, for a replay after a crash\n"
     '        with open("engine-journal.jsonl", "a") as fh:\n'
     "            for c, row in ready:\n"
     '                fh.write(json.dumps({"rid": c.request.request_id, "logits": row.tolist()}) + "\\n")\n'
     "                fh.flush()\n"
     "                os.fsync(fh.fileno())\n"
     "\n"
     "    def _on_admitted(self, req: Request) -> None:\n"),
    (ENGINE, "import itertools\n", "import itertools\nimport json\nimport os\n"),
))

ALLOCATION_CHURN = Plant("allocation churn that triggers collections", (
    (ENGINE,
     "        for req, tok in zip(reqs, tokens):\n",
     "        for row in logits.tolist():\n"
     "            ranked = sorted(((p, i) for i, p in enumerate(row)), reverse=True)\n"
     "            self._recent.append(ranked)  # the last steps' rankings, for a debug endpoint\n"
     "        for req, tok in zip(reqs, tokens):\n"),
    (ENGINE,
     "        self._num_waiting = 0  # inbox + scheduler queue, kept under the lock for max_waiting\n",
     "        self._num_waiting = 0  # inbox + scheduler queue, kept under the lock for max_waiting\n"
     "        self._recent: collections.deque[list[tuple[float, int]]] = collections.deque(maxlen=2048)\n"),
    (ENGINE, "import asyncio\n", "import asyncio\nimport collections\n"),
))


HANDLER = "src/refstack/server/openai_routes.py"


def fix_diff(ws: Path) -> str:
    """The diff that takes ``AUDIT_CHECK``'s call out of a tree that holds it (made in the tree, then undone)."""
    path = ws / HANDLER
    planted = path.read_text()
    call = AUDIT_CHECK.edits[0][2].splitlines(keepends=True)[-1]
    path.write_text(planted.replace(call, ""))
    diff = git(ws, "diff")
    path.write_text(planted)
    return diff


def regressed_workspace(dest: Path) -> tuple[Path, str]:
    """A code workspace whose committed tree holds ``AUDIT_CHECK``, and the diff that fixes it."""
    ws = code_workspace(dest)
    AUDIT_CHECK.apply(ws)
    git(ws, "commit", "-qam", "audit each request (synchronously)")
    return ws, fix_diff(ws)


def timeline(ws: Path, workdir: Path, scenario: str, **config: Any) -> Feedback:
    """One timeline probe window of ``scenario`` on the workspace's server, py-spy on the server process."""
    fb = TimelineProbe().execute({"scenarios": [scenario], "sample_process": "server", **config},
                                 ProbeContext(workdir=workdir, workspace=load_workspace(ws), progress=False))
    assert fb.ok, fb.error
    return fb


def warnings_of(fb: Feedback, kind: str) -> list[Finding]:
    return [f for f in fb.findings if f.kind == kind and f.severity == "warning"]


def describe(fb: Feedback) -> str:
    """The findings as the agent reads them, for an assertion's message."""
    return "\n".join(f"{f.kind} [{f.severity}] {f.message} @ {f.location}" for f in fb.findings)
