"""The executor interface: run a planned experiment, return what it measured.

The loop talks to an executor only through ``execute`` / ``measure`` / ``finalize`` /
``cleanup`` (and ``restore`` when it starts), so a distributed executor (experiments
as tasks on other machines) can replace the local one without the loop changing.  An executor never judges: it returns the
Feedback of each side and the cheap gates it ran, and the loop's judge decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from infra_agent.agent.planner import Plan
from infra_agent.errors import ServerExitedEarly
from infra_agent.feedback import Feedback
from infra_agent.records import Experiment

OnEvent = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Refusal:
    """The candidate's server exited before it was ready: it refused its configuration.

    ``reason`` is the engine's error line from its log (None when the log names none); the
    log itself stays where the server wrote it."""

    server: str
    exit_code: int
    reason: str | None
    log_path: str | None = None

    @classmethod
    def of(cls, exc: ServerExitedEarly) -> Refusal:
        return cls(server=exc.name, exit_code=exc.exit_code, reason=exc.reason, log_path=exc.log_path)


@dataclass
class Execution:
    status: Literal["done", "error", "timeout", "rejected"]
    error: str | None = None
    # scenario (ab) or check name (pair) -> one Feedback per run, index-paired across sides
    candidate: dict[str, list[Feedback]] = field(default_factory=dict)
    baseline: dict[str, list[Feedback]] = field(default_factory=dict)
    checks: dict[str, Feedback] = field(default_factory=dict)  # cheap gates run on the candidate first
    wall_s: float = 0.0
    e2e_runs: int = 0
    probe_runs: int = 0
    launches: int = 0  # server processes started
    refusal: Refusal | None = None  # set when the candidate's server refused its configuration


class Executor(ABC):
    name: str = "executor"
    # Set inside ``fresh_checks``: every check runs again instead of reusing an earlier
    # run of the same (check, config, knobs, code).
    fresh: bool = False

    @contextmanager
    def fresh_checks(self) -> Iterator[None]:
        """Run checks anew in this block: a second round of measurements (``top_up``) that
        reused the first round's check results would pool the same samples twice and
        narrow the interval on nothing."""
        self.fresh = True
        try:
            yield
        finally:
            self.fresh = False

    @abstractmethod
    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        """Run the plan for ``exp`` against ``best`` (the A side)."""

    @abstractmethod
    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        """Measure one configuration alone (the baseline): serving windows and checks."""

    @abstractmethod
    def finalize(self, exp: Experiment, accepted: bool, message: str) -> str | None:
        """Keep (commit) or discard the experiment's code; returns the commit of an accepted code change."""

    @abstractmethod
    def cleanup(self, exp_ids: list[str] | None = None) -> list[str]:
        """Kill leftover processes and remove leftover worktrees (of ``exp_ids``, or of the whole run)."""

    def restore(self, best: Experiment) -> None:
        """Make what the run keeps (its branch of accepted commits) match ``best``, after a killed run.

        A run killed between a commit and the ledger's record of it leaves a commit the
        ledger does not know; the default keeps nothing, so there is nothing to restore."""
        return
