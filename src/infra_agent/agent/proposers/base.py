"""The proposer interface: read the loop's state, return the next step (or stop).

A proposer is chosen with ``--proposer``: ``rules`` (a declarative playbook),
``search`` (Optuna over the knobs, guided by attribution) or ``llm`` (an
OpenAI-compatible chat model with tool calls).  All three see the same
``LoopState``; none of them runs anything itself: the loop sends the returned
``Step`` through the planner and the executor, and records the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from infra_agent.feedback import Feedback, Finding
from infra_agent.records import Experiment, GateResult, RunRecord, Step


@dataclass
class LoopState:
    """What a proposer may read.  Built fresh by the loop before each ``propose``."""

    workspace: Any  # infra_agent.workspace.Workspace
    run: RunRecord
    best: Experiment  # the current best (the baseline until something is accepted)
    history: list[Experiment]  # every experiment of this run so far, in order
    # The latest feedback measured on the best configuration (e2e and checks).
    feedback: list[Feedback] = field(default_factory=list)
    gates: list[GateResult] = field(default_factory=list)  # the best configuration's gate table
    code_root: Path | None = None  # where the best configuration's code is (read-only for proposers)
    budget_runs_left: int | None = None
    budget_s_left: float | None = None

    @property
    def failing_gates(self) -> list[GateResult]:
        return [g for g in self.gates if g.outcome == "fail"]

    @property
    def findings(self) -> list[Finding]:
        return [f for fb in self.feedback for f in fb.findings]

    def tried(self) -> set[str]:
        """Change keys already tried in this run (any outcome)."""
        return {e.change.key() for e in self.history if e.parent is not None}

    def best_knobs(self) -> dict[str, Any]:
        return dict(self.best.knobs)


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, state: LoopState) -> Step | None:
        """The next step, or None when this proposer has nothing more to try."""
        ...

    def observe(self, state: LoopState, experiment: Experiment) -> None:
        """Called after each experiment finishes (the LLM proposer turns it into a tool result)."""
        ...
