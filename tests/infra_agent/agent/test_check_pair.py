"""The rounds of a timed check (agent/executors/check_pair.py): their order, and what a failure keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.executors.check_pair import run_check_pair
from infra_agent.agent.planner import Plan
from infra_agent.feedback import Feedback, Tier
from infra_agent.records import Experiment, Hypothesis, ProbeCall

A, B = Path("/parent"), Path("/candidate")


class Runs:
    """Stands in for the executor's ``_probe``: answers from a script, records the order."""

    def __init__(self, pairs: int, failing: set[tuple[str, int]] = frozenset()) -> None:
        self.pairs, self.fresh, self.failing = pairs, False, failing
        self.calls: list[str] = []
        self.fresh_seen: list[bool] = []

    def _probe(self, exp_id: str, ws_dir: Path, check: str, knobs: dict[str, Any], extra: Any, on_event: Any) -> Feedback:
        side = "a" if ws_dir == A else "b"
        n = sum(1 for c in self.calls if c.startswith(side))
        self.calls.append(f"{side}{n}")
        self.fresh_seen.append(self.fresh)
        return Feedback(probe="kernel", tier=Tier.micro, ok=(side, n) not in self.failing, meta={"run": f"{side}{n}"})


def _exp(id_: str) -> Experiment:
    return Experiment(id=id_, run_id="r", seq=0, hypothesis=Hypothesis(statement="s", metric="achieved_bandwidth",
                                                                          direction="higher", min_effect=0.05))


def _run(runs: Runs, tier: Tier = Tier.micro) -> Execution:
    plan = Plan(ProbeCall(name="kernel", config={"mode": "bench"}, tier=tier, check="mm"), "pair", check="mm")
    ex = Execution(status="done")
    run_check_pair(runs, _exp("e1"), _exp("e0"), plan, (A, B), {}, ex, None)
    return ex


def _kept(ex: Execution) -> tuple[list[str], list[str]]:
    return ([fb.meta["run"] for fb in ex.baseline.get("mm", [])], [fb.meta["run"] for fb in ex.candidate.get("mm", [])])


def test_a_timing_runs_fresh_rounds_in_a_b_b_a_order() -> None:
    runs = Runs(pairs=3)
    ex = _run(runs)
    assert runs.calls == ["a0", "b0", "b1", "a1", "a2", "b2"]
    assert _kept(ex) == (["a0", "a1", "a2"], ["b0", "b1", "b2"]) and ex.probe_runs == 6
    assert all(runs.fresh_seen) and runs.fresh is False  # the parent is run again, then the flag is restored


def test_a_correctness_check_runs_once_a_side_from_the_cache() -> None:
    runs = Runs(pairs=3)
    ex = _run(runs, tier=Tier.check)
    assert runs.calls == ["a0", "b0"] and _kept(ex) == (["a0"], ["b0"]) and runs.fresh_seen == [False, False]


@pytest.mark.parametrize(("failing", "calls", "kept"), [
    # refused in the first round: that round is the verdict
    ({("b", 0)}, ["a0", "b0"], (["a0"], ["b0"])),
    # refused in a later round (B first): only the failure is kept, beside the last parent run
    ({("b", 1)}, ["a0", "b0", "b1"], (["a0"], ["b1"])),
    # in the third round (A first): that round alone
    ({("b", 2)}, ["a0", "b0", "b1", "a1", "a2", "b2"], (["a2"], ["b2"])),
    # the parent failed in a later round: that round is dropped, the complete ones stay paired
    ({("a", 1)}, ["a0", "b0", "b1", "a1"], (["a0"], ["b0"])),
])
def test_a_failure_ends_the_rounds_and_good_rounds_before_it_do_not_make_it_promising(
        failing: set[tuple[str, int]], calls: list[str], kept: tuple[list[str], list[str]]) -> None:
    runs = Runs(pairs=3, failing=failing)
    ex = _run(runs)
    assert runs.calls == calls and _kept(ex) == kept
