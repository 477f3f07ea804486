"""The run's prompt sets: each job a block no other job draws from, kept across a resume."""

from __future__ import annotations

from pathlib import Path

from infra_agent.agent.executors.prompt_sets import (
    MAX_RERUNS,
    PromptSetCounter,
    block_size,
    slot_set,
)


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
