"""Cheats proposed through the real loop: the stand-in model's script, real worktrees and workers.

Each cheat is one scripted change (a diff and/or knob values) and the hypothesis the
cheat hopes to see supported.  A run tries several cheats in turn after one baseline
(the pending change is cleared after each ``run_experiment``), so a family of cheats
costs one baseline, not one each.  What every entry must show: refused, or measured as
no gain; never accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.demo.build import build_demo_workspace
from infra_agent.ledger import Ledger
from infra_agent.records import Experiment
from infra_agent.standin.server import received_requests, serve_standin

from ...agent.loop_workspace import git


@dataclass(frozen=True)
class Cheat:
    name: str
    metric: str
    direction: str = "lower"
    min_effect: float = 1.0
    diff: str | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    scenario: str | None = None
    component: str = "model.lm_head"


def new_file(path: str, text: str) -> str:
    """A git diff that adds ``path`` holding ``text``."""
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


def script(cheats: list[Cheat]) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    for c in cheats:
        if c.diff:
            turns.append({"tool_calls": [{"tool": "propose_diff", "arguments": {"diff": c.diff}}]})
        if c.knobs:
            turns.append({"tool_calls": [{"tool": "set_knobs", "arguments": {"knobs": c.knobs}}]})
        turns.append({"tool_calls": [{"tool": "run_experiment", "arguments": {
            "statement": f"{c.name}: the change improves {c.metric}", "metric": c.metric, "direction": c.direction,
            "min_effect": c.min_effect, "scenario": c.scenario, "locality": {"component": c.component}}}]})
    turns.append({"tool_calls": [{"tool": "finish", "arguments": {"reason": "every cheat was tried"}}]})
    return {"turns": turns, "on_exhausted": "finish"}


def demo_workspace(root: Path, *, extra: dict[str, Any] | None = None) -> Path:
    """The demo's workspace (refstack behind a server target, the tp-numerics kernel gate),
    with a short chat window: these tests are about the gate, not about speed."""
    build_demo_workspace(root)
    path = root / "infra-agent.yaml"
    spec = yaml.safe_load(path.read_text())
    spec["scenarios"]["chat"].update(num_requests=4, warmup_requests=1)
    for key, value in (extra or {}).items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=100))
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "cheat catalogue workspace")
    return root


@dataclass
class Tried:
    """What the loop made of the cheats: their experiments in order, and every tool result the model read."""

    experiments: list[Experiment]
    tool_results: list[str]

    def only(self) -> Experiment:
        assert len(self.experiments) == 1, [(e.id, e.status, e.error) for e in self.experiments]
        return self.experiments[0]


def try_cheats(ws: Path, cheats: list[Cheat]) -> Tried:
    """Run the loop with the stand-in model proposing ``cheats``, one after the other."""
    with serve_standin(script(cheats)) as url:
        run = start_run(ws, RunOptions(proposer="llm", model="standin", base_url=url, budget_runs=len(cheats),
                                       confirm=False, top_up=False, look_again=False),
                        progress=False)
        sent = received_requests(url)
    with Ledger.for_workspace(ws) as ledger:
        exps = sorted((e for e in ledger.experiments(run.id) if e.role == "experiment"), key=lambda e: e.seq)
    # Each request carries the whole conversation: the last one holds every tool result.
    messages = sent[-1].get("messages") or [] if sent else []
    return Tried(exps, [str(m.get("content", "")) for m in messages if m.get("role") == "tool"])


def by_cheat(tried: Tried, cheats: list[Cheat]) -> dict[str, Experiment]:
    """Each cheat's experiment, by name (every cheat here reaches the executor)."""
    assert len(tried.experiments) == len(cheats), [(e.id, e.status, e.error) for e in tried.experiments]
    return {c.name: e for c, e in zip(cheats, tried.experiments, strict=True)}


def never_accepted(exp: Experiment) -> str:
    """Assert ``exp`` was refused or measured as no gain; returns how it ended, for messages."""
    outcome = exp.verdict.outcome if exp.verdict is not None else None
    assert not exp.accepted and exp.commit is None, (exp.status, outcome, exp.error)
    assert exp.status == "rejected" or outcome in (None, "refuted", "inconclusive", "rejected"), (exp.status, outcome)
    return f"{exp.status}: {exp.error or (exp.verdict.message if exp.verdict else '')}"
