"""The run's prompt sets: each job a block no other job draws from, kept across a resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.agent.executors.local import LocalExecutor
from infra_agent.agent.executors.prompt_sets import (
    MAX_RERUNS,
    GivenBlock,
    PromptSetCounter,
    block_size,
    slot_set,
)
from infra_agent.agent.planner import Plan
from infra_agent.feedback import Feedback, Tier
from infra_agent.records import Experiment, Hypothesis, ProbeCall
from infra_agent.workspace import load_workspace

from .loop_workspace import make_workspace


def test_a_jobs_windows_draw_distinct_sets_inside_its_block() -> None:
    slots, per_slot, first = 4, 2, 30
    size = block_size(slots, per_slot)
    starts = [slot_set(first, slots, per_slot, s, a) for a in range(MAX_RERUNS + 1) for s in range(slots)]
    windows = [start + r for start in starts for r in range(per_slot)]
    assert len(set(windows)) == len(windows) == size
    assert min(windows) == first and max(windows) == first + size - 1
    # Without a re-run the job draws the front of its block only.
    assert max(slot_set(first, slots, per_slot, s, 0) for s in range(slots)) + per_slot == first + slots * per_slot


def test_blocks_never_overlap_and_the_count_survives_a_restart(tmp_path: Path) -> None:
    counter = PromptSetCounter(tmp_path / "run")
    one = counter.reserve(9)
    two = counter.reserve(9)
    assert (one, two) == (0, 9)
    counter.settle(two, 9, 3)  # the job drew 3 sets: the rest goes back
    resumed = PromptSetCounter(tmp_path / "run")  # a resumed run reads the file
    assert resumed.reserve(6) == 12
    # A job that said nothing (it failed) keeps its whole block; a block settled late
    # (another was reserved since) is not given back over the newer one.
    three = resumed.reserve(9)
    resumed.settle(three, 9, None)
    four = resumed.reserve(9)
    resumed.settle(three, 9, 1)
    assert four == three + 9 and resumed.reserve(1) == four + 9


def _exp(exp_id: str, **kw: object) -> Experiment:
    return Experiment(id=exp_id, run_id="rt", seq=int(exp_id[1:]), parent="e0",
                      hypothesis=Hypothesis(statement="s", metric="output_throughput", direction="higher"), **kw)  # type: ignore[arg-type]


def _sets(runs: list[Feedback]) -> list[int]:
    return [int(w["window"]) for fb in runs for w in fb.meta["prompts"]]


@pytest.mark.slow
def test_every_window_of_a_run_sends_prompts_no_earlier_window_sent(tmp_path: Path) -> None:
    """The baseline's repeats, an A/B and a second batch of it, on a real refstack: no prompt
    set twice, except the two sides of one pair; a resumed executor goes on after them."""
    root = make_workspace(tmp_path / "ws")
    ex = LocalExecutor(load_workspace(root), "rt", pairs=2)
    base = _exp("e0", role="baseline")
    measured = ex.measure(base, ["chat"], 2, [])
    assert measured.status == "done", measured.error
    exp = _exp("e1", knobs={"max_running": 2})
    plan = Plan(probe=ProbeCall(name="serving", tier=Tier.e2e), mode="ab", scenarios=["chat"],
                result_metrics=["output_throughput"])
    batches = [ex.execute(exp, plan, base), ex.execute(exp, plan, base)]  # the second: an extra batch
    assert all(b.status == "done" for b in batches), [b.error for b in batches]
    ex.finalize(exp, False, "")
    a = [s for b in batches for s in _sets(b.baseline["chat"])]
    b_ = [s for b in batches for s in _sets(b.candidate["chat"])]
    assert a == b_, "the two sides of a pair must send the same prompts"
    every = _sets(measured.candidate["chat"]) + a
    assert len(every) == 6 and len(set(every)) == 6, every
    # The seed each window used is in its result, and the windows' seeds differ as their sets do.
    seeds = {w["seed"] for fb in batches[0].candidate["chat"] + measured.candidate["chat"] for w in fb.meta["prompts"]}
    assert len(seeds) == 4
    assert PromptSetCounter(ex.jobs_dir).reserve(1) > max(every)  # what a resumed run would draw next


def test_a_ray_task_draws_from_the_block_its_driver_reserved() -> None:
    block = GivenBlock(40)
    seen: list[int] = []
    out = block.run_block((2, 1), lambda first: seen.append(first) or {"prompt_sets_used": 2})
    assert seen == [40] and out == {"prompt_sets_used": 2}
