"""The loop's collaborators, as the loop uses them: one place that says what each must do.

- **Proposer** (agent/proposers/base.py): reads the loop's state, returns the next step or
  None; ``stopped_reason`` says why it returned None, for the run's message.
- **Executor** (agent/executors/base.py): runs a planned experiment and returns what it
  measured; an abstract base class, since every executor shares its ``fresh_checks``.
- **StepPlanner**: the cheapest probe for a step (agent/planner.py's ``Planner``), learning
  the probes' real costs as the run goes.
- **RunLedger**: where every state change is written first (infra_agent/ledger's
  ``Ledger``), so a killed run resumes without losing or repeating an experiment.

Structural types: the loop's tests pass scripted stand-ins without subclassing anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from infra_agent.agent.executors.base import Executor
from infra_agent.agent.planner import Plan
from infra_agent.agent.proposers.base import Proposer
from infra_agent.records import Experiment, RunRecord, Step


class StepPlanner(Protocol):
    def plan(self, step: Step, changed_components: list[str]) -> Plan:
        """The probe, the mode and the cheap gates for ``step``; InfraAgentError when no probe can answer it."""
        ...

    def learn(self, costs: Mapping[tuple[str, str], Any]) -> None:
        """The mean cost of each (probe, tier) so far, from the ledger."""
        ...


class RunLedger(Protocol):
    def experiments(self, run_id: str) -> list[Experiment]:
        """The run's experiments, by ``seq``."""
        ...

    def next_seq(self, run_id: str) -> int:
        """One past the run's highest ``seq``."""
        ...

    def save_experiment(self, exp: Experiment) -> None: ...

    def save_run(self, run: RunRecord) -> None: ...

    def probe_costs(self) -> Mapping[tuple[str, str], Any]:
        """(probe name, tier) -> what it cost over finished experiments, for the planner."""
        ...


__all__ = ["Executor", "Proposer", "RunLedger", "StepPlanner"]
