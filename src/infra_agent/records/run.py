"""The record of one ``infra-agent run``: its options, where it stands, its gate tables."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infra_agent.records.gate import GateResult

# done / budget: the run ended (its message says whether every gate passes); not_confirmed: the
# confirmation of the best against the baseline did not confirm (agent/conclusion.py).
RunStatus = Literal["running", "done", "interrupted", "error", "budget", "not_confirmed"]


class RunRecord(BaseModel):
    """One ``infra-agent run``: its options, where it stands, and its gate tables."""

    model_config = ConfigDict(extra="forbid")

    id: str
    workspace: str  # the workspace root
    proposer: str
    status: RunStatus = "running"
    started_at: float
    finished_at: float | None = None
    # Everything needed to resume: budgets, pairs, proposer options, scenario choice.
    options: dict[str, Any] = Field(default_factory=dict)
    baseline: str | None = None  # the baseline experiment's id
    best: str | None = None  # the current best experiment's id
    branch: str | None = None  # the git branch that collects accepted commits
    gates_before: list[GateResult] = Field(default_factory=list)
    gates_after: list[GateResult] = Field(default_factory=list)
    message: str = ""
