"""The proposer interface: read the loop's state, return the next step (or stop).

A proposer is chosen with ``--proposer``: ``rules`` (a declarative playbook),
``search`` (Optuna over the knobs, guided by attribution) or ``llm`` (an
OpenAI-compatible chat model with tool calls).  All three see the same
``LoopState``; none of them runs anything itself: the loop sends the returned
``Step`` through the planner and the executor, and records the verdict.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from infra_agent.records import Experiment, LoopState, Step


@runtime_checkable
class Proposer(Protocol):
    name: str
    # Why ``propose`` last returned None, in one sentence (None: no reason given); the loop
    # reports it as the run's stop reason.
    stopped_reason: str | None

    def propose(self, state: LoopState) -> Step | None:
        """The next step, or None when this proposer has nothing more to try."""
        ...

    def observe(self, state: LoopState, experiment: Experiment) -> None:
        """Called after each experiment finishes (the LLM proposer turns it into a tool result)."""
        ...
