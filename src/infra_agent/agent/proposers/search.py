"""The ``search`` proposer: Optuna's TPE over the knob space, guided by attribution.

The objective is the statistic of the first failing gate of the best configuration
(``output_throughput>=300 @chat``: maximise ``output_throughput`` in scenario ``chat``; a
check's ``kv_transfer_prefill_ratio>=0.95``: maximise that ratio, every trial running the
check on both sides), else the workspace's first criterion.  Every trial is one
experiment: ``propose`` asks Optuna for a trial and returns it as a ``Step``;
``observe`` tells the trial the candidate's score, or marks it failed.  The score is what
the judge measures (:class:`~infra_agent.agent.proposers.search_objective.PairedScores`):
the candidate against its interleaved parent, chained from the baseline, so a trial that
ran in a quiet moment is not a new best.

Each searchable knob (``search_knobs.py``) is sampled inside its search range (``search_ranges.py``): its ``typical``
range first, never above what the machine allows, widened only when attribution ranks the
knob and the best value sits at the range's edge.  A configuration that breaks one of the
workspace's ``constraints``, oversubscribes the machine or launches the same thing as the
best (knob ``aliases``, an identical rendered launch) is never proposed: it counts as a
repeat.  From each best configuration the attributed knobs are first moved one at a
time (x2, /2, the next choice: local moves); TPE samples them jointly once local moves
stop paying (each tried, or ``LOCAL_MISSES`` in a row without improvement).  Where no
finding points at any knob, every knob gets its local move before TPE: a joint draw of
six knobs from a healthy default answers no single question.

Attribution (:func:`~infra_agent.agent.proposers.attribution.rank_knobs`) decides the
order in which knobs join the search space.  The space starts with the ``top_k``
knobs the findings point at, and widens (the next-ranked knobs, then every knob) once
the current space is exhausted: every configuration of a discrete space tried, or
``widen_after`` trials without improving the best value.  Knobs outside the space stay
at the best configuration's values; they are still recorded in every trial (as fixed
parameters), so that TPE has their history when they join.  ``blind=True`` searches
every knob from the first trial: the baseline that shows what attribution buys.

The study is a function of the experiments it has seen (``search_trials.py``):
``restore(history)`` rebuilds it from the ledger (``study.add_trial``), so a resumed run
neither loses nor repeats a finished trial.  A configuration already tried is never
proposed again.
"""

from __future__ import annotations

import random
from typing import Any

import optuna
from optuna.trial import Trial

from infra_agent.agent.planner import NAMED
from infra_agent.agent.proposers.attribution import KnobScore
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search_knobs import SearchKnobs
from infra_agent.agent.proposers.search_objective import (
    Objective,
    objective_for,
    step_min_effect,
)
from infra_agent.agent.proposers.search_ranges import KnobRange
from infra_agent.agent.proposers.search_space import (
    LOCAL_MISSES,
    StagedSpace,
    untried_points,
)
from infra_agent.agent.proposers.search_step import Stage, search_step
from infra_agent.agent.proposers.search_trials import PendingTrial, TrialBook
from infra_agent.records import Change, Experiment, GateResult, Step

MAX_RESAMPLE = 24  # samples per proposal before a repeated configuration counts as exhaustion
DEFAULT_STARTUP_TRIALS = 5  # random trials before TPE models; e2e trials are too costly for Optuna's 10


class SearchProposer:
    """Optuna TPE over the knobs; attribution picks the knobs to search first."""

    name = "search"

    def __init__(
        self,
        seed: int = 0,
        blind: bool = False,
        widen_after: int | None = None,
        n_startup_trials: int | None = None,
        min_effect: float = 0.05,
        top_k: int = 2,
    ) -> None:
        if widen_after is not None and widen_after < 1:
            raise ValueError(f"widen_after must be >= 1, got {widen_after}")
        if n_startup_trials is not None and n_startup_trials < 0:
            raise ValueError(f"n_startup_trials must be >= 0, got {n_startup_trials}")
        if min_effect < 0:
            raise ValueError(f"min_effect must be >= 0, got {min_effect}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.seed = seed
        self.blind = blind
        self.widen_after = widen_after
        self.n_startup_trials = DEFAULT_STARTUP_TRIALS if n_startup_trials is None else n_startup_trials
        self.min_effect = min_effect
        self._step_min_effect = min_effect  # this proposal's: less where the gate lacks less (step_min_effect)
        self.top_k = top_k
        # Optuna logs every finished trial at INFO; the loop reports experiments itself.
        optuna.logging.set_verbosity(optuna.logging.WARNING)

        self._knobs = SearchKnobs(blind)  # the searchable knobs and their ranges (search_knobs.py)
        self._book = TrialBook(self.name, self._knobs, seed, self.n_startup_trials)  # the study (search_trials.py)
        self._space = StagedSpace(blind, top_k)  # the stages of knobs to search (search_space.py)
        self._rng = random.Random(seed)
        self.stopped_reason: str | None = None  # why ``propose`` returned None (the loop reports it)

    # ------------------------------------------------------------ read-only views

    @property
    def study(self) -> optuna.Study | None:
        return self._book.study

    @property
    def objective(self) -> Objective | None:
        return self._book.objective

    @property
    def ranking(self) -> list[KnobScore]:
        return list(self._space.ranking or [])

    @property
    def searchable(self) -> tuple[str, ...]:
        return tuple(self._knobs.dists)

    @property
    def stages(self) -> list[tuple[str, ...]]:
        return list(self._space.stages)

    @property
    def active(self) -> tuple[str, ...]:
        """The knobs searched now (empty before the first proposal)."""
        return self._space.active

    @property
    def widenings(self) -> list[str]:
        return list(self._space.widenings)

    def search_range(self, name: str) -> KnobRange | None:
        """Where ``name`` is sampled now (None when it is not searched)."""
        return self._knobs.ranges.get(name)

    def score(self, exp_id: str) -> float | None:
        """An experiment's relative score on the objective (the baseline's is 1.0)."""
        scores = self._book.scores
        return scores.score(exp_id) if scores is not None else None

    def best_value(self) -> float | None:
        return self._book.best_value()

    # ------------------------------------------------------------ Proposer

    def propose(self, state: LoopState) -> Step | None:
        self._bind(state.workspace)
        if not self._knobs.dists:
            self.stopped_reason = "the workspace has no searchable knob (bounded, not calibration)"
            return None
        objective = objective_for(state.workspace, state.gates)
        if objective is None:
            self.stopped_reason = "the workspace has no criterion and no scenario to measure"
            return None
        book = self._book
        if book.objective is None:
            book.objective = objective
        elif objective != book.objective and self._objective_met(state.gates):
            book.switch(objective)
            self._space.restart(f"objective is now {objective.metric} ({objective.source})")
        book.backlog.extend(state.history)
        book.flush()
        book.drop_pending()
        self._step_min_effect = step_min_effect(state.gates, book.objective, self.min_effect)
        if self._space.ranking is None:
            self._space.rank(state, self._knobs.dists, book.records)
        elif state.best.id != self._space.ranked_on and not self.blind:
            self._space.rerank(state, self._knobs.dists, book.records)
        base = book.best_config(state)
        tried_changes = book.tried_changes | state.tried()
        while True:
            active = self._space.active
            last = self._space.last
            self._widen_ranges(active, base)
            reason = None if last else self._exhausted(active, base, tried_changes)
            if reason is None:
                move = self._local_move(state.best.id, active, base, tried_changes)
                if move is not None:
                    return self._step(move[0], move[1], active, local=move[2])
                got = self._sample(active, base, tried_changes)
                if got is not None:
                    return self._step(got[0], got[1], active)
                if last:
                    self.stopped_reason = "the search proposer found no untried configuration of its knobs"
                    return None
                reason = f"{MAX_RESAMPLE} samples in a row repeated tried configurations"
            self._space.widen(reason, book.records)

    def observe(self, state: LoopState, experiment: Experiment) -> None:
        self._bind(state.workspace)
        self._book.backlog.append(experiment)
        self._book.flush()

    def restore(self, history: list[Experiment], workspace: Any = None) -> None:
        """Rebuild the study from a run's experiments (a resumed run).

        Finished experiments become finished trials (``study.add_trial``); their knob
        values count as tried.  Without ``workspace`` the trials are added at the next
        ``propose``, which knows the workspace's knobs.
        """
        if workspace is not None:
            self._bind(workspace)
        if self._book.objective is None:
            own = [e for e in history if e.proposer == self.name and e.parent is not None]
            if own:
                h, probe = own[-1].hypothesis, own[-1].probe
                # The search names a check as its probe only for an objective from that check.
                check = probe.check if probe is not None and probe.reason == NAMED else None
                self._book.objective = Objective(h.metric, h.direction, h.scenario, source="restored", check=check)
        self._book.backlog.extend(history)
        self._book.flush()

    # ------------------------------------------------------------ the workspace and the objective

    def _bind(self, workspace: Any) -> None:
        if self._knobs.workspace is not None:
            return
        self._knobs.bind(workspace)
        self._book.cand.workspace = workspace

    def _objective_met(self, gates: list[GateResult]) -> bool:
        """The current objective's gate passes now, so another failing gate may take over."""
        objective = self._book.objective
        assert objective is not None
        for g in gates:
            spec = g.spec if g.kind in ("absolute", "relative", "check") else None
            if spec and spec.metric == objective.metric and spec.scenario == objective.scenario \
                    and (g.kind == "check") == (objective.check is not None):
                return g.outcome == "pass"
        return False

    # ------------------------------------------------------------ the active space (search_space.py)

    def stale_trials(self) -> int:
        """This stage's trials since the best value last improved."""
        assert self._book.objective is not None
        return self._space.stale_trials(self._book.records, self._book.objective)

    def _exhausted(self, active: tuple[str, ...], base: dict[str, Any], tried_changes: set[str]) -> str | None:
        limit = self.widen_after or 4 * len(active)
        stale = self.stale_trials()
        if stale >= limit:
            return f"{stale} trials without improving the best"
        if self._untried(active, base, tried_changes) == []:
            return f"every configuration of {', '.join(active)} tried"
        return None

    def _untried(self, active: tuple[str, ...], base: dict[str, Any], tried_changes: set[str]) -> list[dict[str, Any]] | None:
        """Every untried point of a discrete space (None when it is continuous or too large)."""
        cand = self._book.cand
        return untried_points(self._knobs.dists, active, lambda values: cand.is_new(values, base, tried_changes))

    # ------------------------------------------------------------ ranges and local moves (search_ranges.py)

    def _attributed(self, active: tuple[str, ...]) -> list[str]:
        """The active knobs attribution ranks (score > 0), in rank order; none in a blind search."""
        if self.blind:
            return []
        ranked = [s.name for s in self._space.ranking or [] if s.score > 0]
        return [k for k in ranked if k in active]

    def _widen_ranges(self, active: tuple[str, ...], base: dict[str, Any]) -> None:
        """A ranked knob whose best value sits at its range's edge: that side of the range grows."""
        for name in self._attributed(active):
            grown = self._knobs.widen_at(name, base.get(name))
            if grown is not None:
                scores = {s.name: s for s in self._space.ranking or []}
                self._space.widenings.append(f"widened {grown} and attribution ranks it ({scores[name].explain()})")

    def _local_move(self, best_id: str, active: tuple[str, ...], base: dict[str, Any],
                    tried_changes: set[str]) -> tuple[Trial, dict[str, Any], bool] | None:
        """The next local move from the best (one attributed knob x2, /2 or to the next choice),
        while they pay; None once TPE should sample the active knobs jointly."""
        movable = self._attributed(active)
        allowed = LOCAL_MISSES
        if not movable and not self.blind and not any(s.score > 0 for s in self._space.ranking or []):
            # No finding points at a knob (a configuration with no bottleneck to name): each knob
            # is moved alone first, so every experiment answers one question (does this knob
            # matter here?), and TPE samples jointly only after each has had its move.
            movable, allowed = list(active), max(LOCAL_MISSES, len(active))
        book = self._book
        assert book.objective is not None
        if not movable or self._space.local_moves_over(book.records, book.objective, best_id, allowed) is not None:
            return None
        moved = self._space.moved_before(book.records, best_id)
        ranges = self._knobs.ranges
        per_knob = [[(k, v) for v in ranges[k].local_moves(base.get(k))] for k in movable if k not in moved]
        # Breadth first: each knob's first move (x2, the next choice), then each one's second.
        for rank in range(2):
            for moves in per_knob:
                if rank < len(moves) and book.cand.is_new({moves[rank][0]: moves[rank][1]}, base, tried_changes):
                    name, value = moves[rank]
                    fixed = {k: base[k] for k in self._knobs.dists if k in base}
                    trial, _ = book.ask({**fixed, name: value}, active)
                    return trial, {name: value}, True
        return None

    # ------------------------------------------------------------ sampling

    def _sample(self, active: tuple[str, ...], base: dict[str, Any], tried_changes: set[str]) -> tuple[Trial, dict[str, Any]] | None:
        book = self._book
        assert book.study is not None
        fixed = {k: base[k] for k in self._knobs.dists if k not in active and k in base}
        for _ in range(MAX_RESAMPLE):
            trial, values = book.ask(fixed, active)
            values = book.cand.effective(values, base)
            if book.cand.is_new(values, base, tried_changes):
                return trial, values
            trial.set_user_attr("repeat", True)  # or infeasible: a broken constraint, the machine, a no-op
            book.tell(trial, None)  # a repeat is never run; FAIL keeps it out of TPE's model
        untried = self._untried(active, base, tried_changes)
        if not untried:
            return None
        values = self._rng.choice(untried)
        trial, values = book.ask({**fixed, **values}, active)
        return trial, book.cand.effective(values, base)

    def _step(self, trial: Trial, values: dict[str, Any], active: tuple[str, ...], local: bool = False) -> Step:
        objective = self._book.objective
        assert objective is not None
        trial.set_user_attr("active", list(active))
        trial.set_user_attr("local", local)
        self._book.pending = PendingTrial(trial, Change(knobs=values, diff=None).key(), active, local)
        space = self._space
        stage = Stage(space.ranking or [], space.stage, len(space.stages), space.widenings, self.blind)
        step = search_step(self._knobs.workspace, objective, values, active, stage, self._knobs.ranges, trial.number,
                           local, self._step_min_effect)
        if self._step_min_effect < self.min_effect:
            step.rationale += (f"; minimum effect {self._step_min_effect:.1%}, what its gate still lacks "
                               f"(less than the search's {self.min_effect:.0%})")
        return step


__all__ = ["SearchProposer"]
