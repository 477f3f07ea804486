"""The search proposer's active space: which knobs it searches now, and when a stage is spent.

Attribution (:func:`~infra_agent.agent.proposers.attribution.rank_knobs`) orders the
knobs; the space starts with the ``top_k`` knobs the findings point at (a knob a finding
names alone first) and widens stage by stage: the next-ranked knobs, then every knob.  A
stage is spent when every configuration of a discrete space is tried, or after a number
of trials without improving the best value (:meth:`StagedSpace.stale_trials`).  A new best
brings its own findings, and the stages are re-planned from them (:meth:`StagedSpace.rerank`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    IntDistribution,
)

from infra_agent.agent.proposers.attribution import KnobScore, rank_knobs
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search_objective import Objective

MAX_ENUMERATE = 4096  # discrete spaces up to this size are enumerated to find an untried point
IMPROVEMENT = 0.01  # a value must beat the best by this relative margin to count as an improvement


LOCAL_MISSES = 2  # local moves in a row without improving the best, before TPE takes over


@dataclass
class TrialRecord:
    """One finished experiment as the search sees it."""

    exp_id: str
    value: float | None  # its score on the objective (search_objective.PairedScores)
    active: tuple[str, ...] | None  # the knobs searched in it, when it is the search proposer's trial
    parent: str | None = None
    local: bool = False  # a local move (one knob x2, /2 or the next choice) from its parent
    changed: tuple[str, ...] = ()  # the knobs its change set


def improvements(records: list[TrialRecord], objective: Objective) -> list[bool]:
    """For each record, whether its value beat every earlier one by ``IMPROVEMENT``."""
    best: float | None = None
    out = []
    for r in records:
        improved = False
        if r.value is not None:
            improved = best is None or objective.better(r.value, best, IMPROVEMENT)
            if best is None or objective.better(r.value, best):
                best = r.value
        out.append(improved)
    return out


class StagedSpace:
    """The stages of knobs to search, the current one, and why it widened."""

    def __init__(self, blind: bool, top_k: int) -> None:
        self.blind = blind
        self.top_k = top_k
        self.ranking: list[KnobScore] | None = None
        self.ranked_on: str | None = None  # the best experiment whose findings made the ranking
        self.stages: list[tuple[str, ...]] = []
        self.stage = 0
        self.stage_start = 0  # index into the proposer's own records where the stage began
        self.widenings: list[str] = []

    @property
    def active(self) -> tuple[str, ...]:
        """The knobs searched now (empty before the first plan)."""
        return self.stages[self.stage] if self.stages else ()

    @property
    def last(self) -> bool:
        return self.stage + 1 >= len(self.stages)

    def plan(self, state: LoopState, searchable: dict[str, BaseDistribution]
             ) -> tuple[list[KnobScore], list[tuple[str, ...]]]:
        """The ranking of the searchable knobs on ``state``'s findings, and the stages it gives."""
        ranking = [s for s in rank_knobs(state.workspace, state.findings, state.failing_gates) if s.name in searchable]
        order = [s.name for s in ranking]
        positive = [s.name for s in ranking if s.score > 0]
        if self.blind or not positive:
            return ranking, [tuple(order)]
        stages = [tuple(positive[:i]) for i in range(self.top_k, len(positive) + self.top_k, self.top_k)]
        if len(positive) < len(order):
            stages.append(tuple(order))
        # A knob a finding names is tried alone first: the measurement said where to look,
        # and sampling a second knob with it would blur what the first trials answer
        # (case B: ``ep_release_gil`` beside a random ``max_batch_tokens``).  A discrete
        # knob's stage ends when its values are tried; a continuous one's when stale.
        if ranking[0].named and len(stages[0]) > 1:
            stages.insert(0, (ranking[0].name,))
        return ranking, stages

    def rank(self, state: LoopState, searchable: dict[str, BaseDistribution], records: list[TrialRecord]) -> None:
        """The first plan; a restored run continues in the stage its last trial searched."""
        self.ranked_on = state.best.id
        self.ranking, self.stages = self.plan(state, searchable)
        own = [r for r in records if r.active is not None]
        if own:
            last = set(own[-1].active or ())
            self.stage = next((i for i, s in enumerate(self.stages) if last <= set(s)), len(self.stages) - 1)
            start = len(own)
            while start > 0 and set(own[start - 1].active or ()) == last:
                start -= 1
            self.stage_start = start

    def rerank(self, state: LoopState, searchable: dict[str, BaseDistribution], records: list[TrialRecord]) -> None:
        """A new best brings its own findings: when they point at other knobs, the search
        starts over from their first stage (the study keeps every trial for TPE).

        Case B: once ``ep_release_gil`` is accepted, the next check finds the engine waiting
        on the transfer thread (``gil_contention`` at ``kv_transfer``), which the
        baseline's ranking never pointed at."""
        self.ranked_on = state.best.id
        ranking, stages = self.plan(state, searchable)
        if stages == self.stages:
            return
        self.ranking, self.stages, self.stage = ranking, stages, 0
        self.stage_start = sum(r.active is not None for r in records)
        self.widenings.append(f"re-ranked on {state.best.id}'s findings: {', '.join(stages[0])} first")

    def restart(self, note: str) -> None:
        """The proposer's records start over (a new objective): the stage counts from the first."""
        self.stage_start = 0
        self.widenings.append(note)

    def widen(self, reason: str, records: list[TrialRecord]) -> None:
        before = self.stages[self.stage]
        self.stage += 1
        self.stage_start = sum(r.active is not None for r in records)
        added = [k for k in self.stages[self.stage] if k not in before]
        self.widenings.append(f"added {', '.join(added)}: {reason}")

    def _in_stage(self, records: list[TrialRecord], objective: Objective) -> list[tuple[TrialRecord, bool]]:
        """This stage's own trials, each with whether it improved the best value."""
        out = []
        own_seen = 0
        for r, improved in zip(records, improvements(records, objective), strict=True):
            if r.active is None:
                continue
            if own_seen >= self.stage_start:
                out.append((r, improved))
            own_seen += 1
        return out

    def stale_trials(self, records: list[TrialRecord], objective: Objective) -> int:
        """This stage's trials since the best value last improved (by ``IMPROVEMENT``)."""
        stale = 0
        for _, improved in self._in_stage(records, objective):
            stale = 0 if improved else stale + 1
        return stale

    def local_moves_over(self, records: list[TrialRecord], objective: Objective, best_id: str,
                         allowed: int = LOCAL_MISSES) -> str | None:
        """Why this stage's local moves from ``best_id`` stop paying (None while they may go on):
        TPE already sampled from it, or ``allowed`` local moves in a row did not improve."""
        mine = [(r, imp) for r, imp in self._in_stage(records, objective) if r.parent == best_id]
        if any(not r.local for r, _ in mine):
            return "TPE sampled from it"
        misses = 0
        for _, improved in reversed(mine):
            if improved:
                break
            misses += 1
        return f"{misses} local moves in a row without improving the best" if misses >= allowed else None

    def moved_before(self, records: list[TrialRecord], best_id: str) -> set[str]:
        """Knobs already moved locally from ``best_id`` in earlier stages: a widened stage moves
        only the knobs it adds (the earlier ones have answered from this best)."""
        own = [r for r in records if r.active is not None][:self.stage_start]
        return {k for r in own if r.local and r.parent == best_id for k in r.changed}


def untried_points(searchable: dict[str, BaseDistribution], active: tuple[str, ...],
                   is_new: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]] | None:
    """Every point of ``active``'s discrete space that ``is_new`` accepts (None when the
    space is continuous or larger than ``MAX_ENUMERATE``)."""
    domains: list[list[Any]] = []
    size = 1
    for k in active:
        d = searchable[k]
        if isinstance(d, CategoricalDistribution):
            values: list[Any] = list(d.choices)
        elif isinstance(d, IntDistribution):
            if (d.high - d.low) // d.step + 1 > MAX_ENUMERATE:
                return None
            values = list(range(d.low, d.high + 1, d.step))
        else:
            return None
        size *= len(values)
        if size > MAX_ENUMERATE:
            return None
        domains.append(values)
    return [values_ for combo in itertools.product(*domains) if is_new(values_ := dict(zip(active, combo)))]
