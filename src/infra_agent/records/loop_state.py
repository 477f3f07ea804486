"""What a proposer (and a tool it calls) may read of the loop: ``LoopState``.

Built fresh by the loop before each ``propose``; records only, so the tools layer reads it
without importing the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra_agent.feedback import Feedback, Finding
from infra_agent.records.experiment import Experiment
from infra_agent.records.gate import GateResult
from infra_agent.records.run import RunRecord


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
