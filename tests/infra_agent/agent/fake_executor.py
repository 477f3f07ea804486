"""An in-process executor for loop tests: serving numbers from a function of the knobs, no servers."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, Executor, OnEvent
from infra_agent.agent.loop import Loop
from infra_agent.agent.planner import Plan, Planner
from infra_agent.agent.progress import RunProgress
from infra_agent.feedback import Feedback, Measurement, Tier
from infra_agent.ledger import Ledger
from infra_agent.records import Experiment, RunRecord, Step
from infra_agent.workspace import load_workspace

from .loop_workspace import make_workspace

NOISE = (1.0, 1.01, 0.99)


def serving(values: list[float], scenario: str = "chat", metric: str = "output_throughput") -> list[Feedback]:
    return [Feedback(probe="serving", tier=Tier.e2e,
                     measurements=[Measurement.from_samples(metric, "tok/s", [v], "higher", scenario=scenario)])
            for v in values]


class Lines(RunProgress):
    """The run's progress lines, kept instead of printed."""

    def __init__(self) -> None:
        super().__init__(None, enabled=False)
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)


class FakeExecutor(Executor):
    name = "fake"

    def __init__(self, throughput: Callable[[dict[str, Any]], float] = lambda k: 100.0 * k.get("max_running", 4) / 4,
                 baseline_error: str | None = None) -> None:
        self.throughput = throughput
        self.baseline_error = baseline_error
        self.plans: list[tuple[str, Plan]] = []
        self.restored: list[str] = []
        self.finalized: list[str] = []

    def _side(self, knobs: dict[str, Any], scenarios: list[str]) -> dict[str, list[Feedback]]:
        return {s: serving([self.throughput(knobs) * n for n in NOISE], s) for s in scenarios}

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        if self.baseline_error:
            return Execution(status="error", error=self.baseline_error)
        return Execution(status="done", candidate=self._side(exp.knobs, scenarios), e2e_runs=3 * len(scenarios),
                         checks={c: Feedback(probe="command", tier=Tier.check) for c in checks})

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        self.plans.append((exp.id, plan))
        if plan.mode == "pair":
            assert plan.check is not None
            fb = [Feedback(probe=plan.probe.name, tier=plan.probe.tier, meta={"failed_checks": 0})]
            return Execution(status="done", candidate={plan.check: fb}, baseline={plan.check: list(fb)})
        return Execution(status="done", candidate=self._side(exp.knobs, plan.scenarios),
                         baseline=self._side(best.knobs, plan.scenarios), e2e_runs=6)

    def finalize(self, exp: Experiment, accepted: bool, message: str) -> str | None:
        self.finalized.append(exp.id)
        return None

    def cleanup(self, exp_ids: list[str] | None = None) -> list[str]:
        return []

    def restore(self, best: Experiment) -> None:
        self.restored.append(best.id)


class Script:
    """A proposer that hands out fixed steps (or raises what it is given)."""

    name = "script"

    def __init__(self, steps: list[Step | Exception], repeat_last: bool = False) -> None:
        self.steps = list(steps)
        self.repeat_last = repeat_last
        self.stopped_reason: str | None = None

    def propose(self, state: Any) -> Step | None:
        if not self.steps:
            return None
        step = self.steps[0] if self.repeat_last and len(self.steps) == 1 else self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def observe(self, state: Any, experiment: Experiment) -> None:
        return None


def new_run(tmp_path: Path, ledger: Ledger, **opts: Any) -> RunRecord:
    run = RunRecord(id=f"r{int(time.time() * 1e6)}", workspace=str(tmp_path), proposer="script", started_at=time.time(),
                    options={"pairs": 3, "budget_runs": 8, "confirm": False, **opts})
    ledger.create_run(run)
    return run


def loop_for(ws: Any, ledger: Ledger, run: RunRecord, proposer: Any, executor: Executor) -> Loop:
    return Loop(ws, ledger, run, proposer, executor, Planner(ws, {}, run.options.get("scenarios")),
                RunProgress(None, enabled=False))


def workspace(tmp_path: Path, **kwargs: Any) -> Any:
    return load_workspace(make_workspace(tmp_path / "ws", **kwargs))
