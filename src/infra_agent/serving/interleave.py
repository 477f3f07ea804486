"""Interleaved A/B runs: A B A B … so that machine drift hits both sides alike.

On a shared machine the background load changes from minute to minute.  Running all
A's and then all B's would attribute that change to the candidate; alternating puts
each A next to a B, and the judge pairs them (``bootstrap_ratio(paired=True)``).
With ``order="abba"`` every other pair is flipped (A B B A …), which also cancels a
linear trend inside a pair (:func:`pair_order`, which the executors' A/B jobs use too).
This is the one A/B runner; the judge launches nothing and compares the runs it is given
(``compare_runs(*runs.complete_pairs(), ...)``).

For two knob configurations both servers are started, kept up for a block of pairs, and
stopped; ``restarts=R`` splits the pairs into R such blocks, each with two fresh
processes.  Restarting per run would add start-up noise and minutes of cost; never
restarting leaves the whole comparison resting on one process per side, and two
processes with the same settings differ by a per-process offset (1.6% for refstack on
a shared 2-core machine) that no number of runs of those two processes can average
out.  Each run is labelled with its ``restart``, and the judge widens its interval by
the calibrated offset divided over the restarts (``bootstrap_ratio(process_noise=...)``).

Each pair draws prompts of its own: both sides of pair ``i`` send prompt set ``i``
(``prompt_sets.py``), so pairing still cancels the prompt mix while no prompt repeats
across the windows for a server's cache to answer from its earlier answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from infra_agent.serving.runner import (
    default_log_dir,
    only_scenario,
    run_benchmark,
    run_on_target,
)
from infra_agent.target import open_target
from infra_agent.workspace.models import Scenario, Workspace

RunFn = Callable[[], dict[str, Any]]
PairRunFn = Callable[[str, int], dict[str, Any]]  # (side "a"/"b", pair index) -> result
OnRun = Callable[[str, int, dict[str, Any]], None]  # (side "a"/"b", pair index, result)


@dataclass
class InterleavedRuns:
    a: list[dict[str, Any]] = field(default_factory=list)
    b: list[dict[str, Any]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)

    def extend(self, other: InterleavedRuns) -> None:
        self.a += other.a
        self.b += other.b
        self.order += other.order

    def complete_pairs(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Pairs where both runs succeeded; a failed run drops its partner so pairing holds."""
        keep = [i for i in range(min(len(self.a), len(self.b))) if self.a[i].get("ok", True) and self.b[i].get("ok", True)]
        return [self.a[i] for i in keep], [self.b[i] for i in keep]

    def write(self, path_a: str | Path, path_b: str | Path) -> None:
        """One file per side, ``{"runs": [...]}``, the form ``infra-agent compare`` reads."""
        for path, runs in ((path_a, self.a), (path_b, self.b)):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({"interleaved": True, "runs": runs}, indent=1) + "\n")


def pair_order(i: int, order: Literal["abab", "abba"] = "abab") -> tuple[str, str]:
    """The sides of pair ``i`` in the order they run: ``abba`` flips every other pair."""
    return ("b", "a") if order == "abba" and i % 2 == 1 else ("a", "b")


def interleave(run_a: RunFn, run_b: RunFn, pairs: int, *, order: Literal["abab", "abba"] = "abab", on_run: OnRun | None = None) -> InterleavedRuns:
    """Call ``run_a``/``run_b`` alternately ``pairs`` times each; failed runs are kept."""
    return interleave_pairs(lambda side, i: (run_a if side == "a" else run_b)(), pairs, order=order, on_run=on_run)


def interleave_pairs(run: PairRunFn, pairs: int, *, order: Literal["abab", "abba"] = "abab",
                     on_run: OnRun | None = None) -> InterleavedRuns:
    """``interleave`` for a ``run(side, pair)`` that needs the pair's index (its prompt set)."""
    assert pairs >= 1
    out = InterleavedRuns()
    for i in range(pairs):
        for side in pair_order(i, order):
            result = run(side, i)
            (out.a if side == "a" else out.b).append(result)
            out.order.append(side)
            if on_run is not None:
                on_run(side, i, result)
    return out


def interleave_urls(
    url_a: str, url_b: str, scenario: Scenario, pairs: int, *, order: Literal["abab", "abba"] = "abab",
    on_run: OnRun | None = None, **run_kwargs: Any,
) -> InterleavedRuns:
    """Two already-running servers, the same scenario, alternated; pair ``i`` sends prompt set ``i``."""
    run_kwargs.setdefault("progress", False)
    urls = {"a": url_a, "b": url_b}
    return interleave_pairs(lambda side, i: run_benchmark(urls[side], scenario, prompt_set=i, **run_kwargs),
                            pairs, order=order, on_run=on_run)


def restart_blocks(pairs: int, restarts: int) -> list[tuple[int, int]]:
    """``[first, end)`` pair indices of each restart's block, as even as integers allow."""
    return [(pairs * r // restarts, pairs * (r + 1) // restarts) for r in range(restarts)]


def interleave_knobs(
    workspace: Workspace,
    knobs_a: Mapping[str, object],
    knobs_b: Mapping[str, object],
    pairs: int,
    *,
    scenario_name: str | None = None,
    scenario: Scenario | None = None,
    log_dir: str | Path | None = None,
    order: Literal["abab", "abba"] = "abab",
    on_run: OnRun | None = None,
    restarts: int = 1,
) -> InterleavedRuns:
    """Start the workspace target twice (knob sets A and B), then alternate runs on them.

    ``restarts``: split the pairs into that many blocks, each on two freshly started
    servers (the side started first alternates), and label every run with its block.
    """
    if not 1 <= restarts <= pairs:
        raise ValueError(f"restarts must be between 1 and the number of pairs ({pairs}), got {restarts}")
    name = scenario_name or only_scenario(workspace)
    sc = scenario or workspace.scenario(name)
    va, vb = workspace.resolve_knobs(knobs_a), workspace.resolve_knobs(knobs_b)
    logs = Path(log_dir) if log_dir else default_log_dir(workspace)
    out = InterleavedRuns()
    for r, (first, end) in enumerate(restart_blocks(pairs, restarts)):
        with ExitStack() as stack:
            order_started = [("a", va), ("b", vb)] if r % 2 == 0 else [("b", vb), ("a", va)]
            targets = {side: stack.enter_context(open_target(workspace, knobs, logs)) for side, knobs in order_started}

            def run(side: str, i: int, r: int = r, first: int = first, targets: dict[str, Any] = targets) -> dict[str, Any]:
                # The pair's index over all blocks: a fresh server must not get an earlier block's prompts either.
                result = run_on_target(targets[side], sc, scenario_name=name, knobs=va if side == "a" else vb,
                                       progress=False, prompt_set=first + i)
                result["restart"] = r
                return result

            def shifted(side: str, i: int, result: dict[str, Any], first: int = first) -> None:
                if on_run is not None:
                    on_run(side, first + i, result)

            out.extend(interleave_pairs(run, end - first, order=order, on_run=shifted))
    return out
