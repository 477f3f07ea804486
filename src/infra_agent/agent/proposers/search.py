"""The ``search`` proposer: Optuna's TPE over the knob space, guided by attribution.

The objective is the metric of the first failing criterion gate of the best
configuration (``output_throughput>=300 @chat``: maximise ``output_throughput`` in
scenario ``chat``), else the workspace's first criterion.  Every trial is one
experiment: ``propose`` asks Optuna for a trial and returns it as a ``Step``;
``observe`` tells the trial the candidate's score, or marks it failed.  The score is what
the judge measures (:class:`~infra_agent.agent.proposers.search_objective.PairedScores`):
the candidate against its interleaved parent, chained from the baseline, so a trial that
ran in a quiet moment is not a new best.

Each knob is sampled inside its search range (``search_ranges.py``): its ``typical``
range first, never above what the machine allows, widened only when attribution ranks the
knob and the best value sits at the range's edge.  A configuration that breaks one of the
workspace's ``constraints``, oversubscribes the machine or launches the same thing as the
best (knob ``aliases``, an identical rendered launch) is never proposed: it counts as a
repeat.  From each best configuration the attributed knobs are first moved one at a
time (x2, /2, the next choice: local moves); TPE samples them jointly once local moves
stop paying (each tried, or ``LOCAL_MISSES`` in a row without improvement).

Attribution (:func:`~infra_agent.agent.proposers.attribution.rank_knobs`) decides the
order in which knobs join the search space.  The space starts with the ``top_k``
knobs the findings point at, and widens (the next-ranked knobs, then every knob) once
the current space is exhausted: every configuration of a discrete space tried, or
``widen_after`` trials without improving the best value.  Knobs outside the space stay
at the best configuration's values; they are still recorded in every trial (as fixed
parameters), so that TPE has their history when they join.  ``blind=True`` searches
every knob from the first trial: the baseline that shows what attribution buys.

The study is a function of the experiments it has seen: ``restore(history)`` rebuilds
it from the ledger (``study.add_trial``), so a resumed run neither loses nor repeats a
finished trial.  A configuration already tried is never proposed again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import Trial, TrialState, create_trial

from infra_agent.agent.proposers.attribution import KnobScore
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search_candidates import Candidates
from infra_agent.agent.proposers.search_objective import (  # re-exported: callers import them from here
    Objective,
    PairedScores,
    distribution,
    is_calibration,
    metric_value,
    objective_for,
    paired_ratio,
)
from infra_agent.agent.proposers.search_ranges import KnobRange, build_ranges
from infra_agent.agent.proposers.search_space import (
    StagedSpace,
    TrialRecord,
    untried_points,
)
from infra_agent.agent.proposers.search_step import Stage, local_stage, search_step
from infra_agent.records import (
    Change,
    Experiment,
    GateResult,
    Step,
)
from infra_agent.workspace.knobs import DomainError

# Calibration knobs (``help: Calibration only; ...``) inject an artificial slowdown
# (a sleep per engine step, a fraction of steps lost) so the judge and the benchmarks
# can be checked against a known effect.  They are never searched: setting them to 0
# "wins" trivially against a calibrated baseline and tells nothing about the system,
# and any other value only makes it slower on purpose.
MAX_RESAMPLE = 24  # samples per proposal before a repeated configuration counts as exhaustion
DEFAULT_STARTUP_TRIALS = 5  # random trials before TPE models; e2e trials are too costly for Optuna's 10

# ``metric op threshold [@scenario]``; relative gates end in `` x baseline`` (judge.gates.gate_label).


@dataclass
class _Pending:
    trial: Trial
    change_key: str
    active: tuple[str, ...]
    local: bool = False


# ---------------------------------------------------------------- the proposer


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
        self.top_k = top_k
        # Optuna logs every finished trial at INFO; the loop reports experiments itself.
        optuna.logging.set_verbosity(optuna.logging.WARNING)

        self._workspace: Any = None
        self._ranges: dict[str, KnobRange] = {}  # where each searchable knob is sampled now
        self._dists: dict[str, BaseDistribution] = {}  # the searchable knobs, by name (their ranges' distributions)
        self._scores: PairedScores | None = None
        self._objective: Objective | None = None
        self._study: optuna.Study | None = None
        self._backlog: list[Experiment] = []  # seen before the study could take them
        self._experiments: list[Experiment] = []  # every finished experiment taken, in order
        self._seen: set[str] = set()
        self._configs: dict[str, dict[str, Any]] = {}  # experiment id -> the knob values it ran
        self._records: list[TrialRecord] = []
        self._cand = Candidates(None)  # the tried configurations, and what a new one must pass (search_candidates.py)
        self._tried_changes: set[str] = set()
        self._pending: _Pending | None = None
        self._space = StagedSpace(blind, top_k)  # the stages of knobs to search (search_space.py)
        self._rng = random.Random(seed)
        self.stopped_reason: str | None = None  # why ``propose`` returned None (the loop reports it)

    # ------------------------------------------------------------ read-only views

    @property
    def study(self) -> optuna.Study | None:
        return self._study

    @property
    def objective(self) -> Objective | None:
        return self._objective

    @property
    def ranking(self) -> list[KnobScore]:
        return list(self._space.ranking or [])

    @property
    def searchable(self) -> tuple[str, ...]:
        return tuple(self._dists)

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
        return self._ranges.get(name)

    def score(self, exp_id: str) -> float | None:
        """An experiment's relative score on the objective (the baseline's is 1.0)."""
        return self._scores.score(exp_id) if self._scores is not None else None

    def best_value(self) -> float | None:
        values = [r.value for r in self._records if r.value is not None]
        if not values or self._objective is None:
            return None
        return max(values) if self._objective.direction == "higher" else min(values)

    # ------------------------------------------------------------ Proposer

    def propose(self, state: LoopState) -> Step | None:
        self._bind(state.workspace)
        if not self._dists:
            self.stopped_reason = "the workspace has no searchable knob (bounded, not calibration)"
            return None
        objective = objective_for(state.workspace, state.gates)
        if objective is None:
            self.stopped_reason = "the workspace has no criterion and no scenario to measure"
            return None
        if self._objective is None:
            self._objective = objective
        elif objective != self._objective and self._objective_met(state.gates):
            self._switch(objective)
        self._backlog.extend(state.history)
        self._flush()
        if self._pending is not None:
            # Proposed but never observed: the loop dropped it.  It stays tried.
            self._tell(self._pending.trial, None)
            self._tried_changes.add(self._pending.change_key)
            self._pending = None
        if self._space.ranking is None:
            self._space.rank(state, self._dists, self._records)
        elif state.best.id != self._space.ranked_on and not self.blind:
            self._space.rerank(state, self._dists, self._records)
        base = self._best_config(state)
        tried_changes = self._tried_changes | state.tried()
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
            self._space.widen(reason, self._records)

    def observe(self, state: LoopState, experiment: Experiment) -> None:
        self._bind(state.workspace)
        self._backlog.append(experiment)
        self._flush()

    def restore(self, history: list[Experiment], workspace: Any = None) -> None:
        """Rebuild the study from a run's experiments (a resumed run).

        Finished experiments become finished trials (``study.add_trial``); their knob
        values count as tried.  Without ``workspace`` the trials are added at the next
        ``propose``, which knows the workspace's knobs.
        """
        if workspace is not None:
            self._bind(workspace)
        if self._objective is None:
            own = [e for e in history if e.proposer == self.name and e.parent is not None]
            if own:
                h = own[-1].hypothesis
                self._objective = Objective(h.metric, h.direction, h.scenario, source="restored")
        self._backlog.extend(history)
        self._flush()

    # ------------------------------------------------------------ study bookkeeping

    def _bind(self, workspace: Any) -> None:
        if self._workspace is not None:
            return
        self._workspace = workspace
        self._cand.workspace = workspace
        # A knob a check compares (``compare_knob``: kv_transfer off vs on) is the criterion's
        # variable, set by the check on both sides: changing it in the configuration moves
        # nothing the check measures, so a trial of it would be wasted.
        compared = {str(c.config.get("compare_knob")) for c in getattr(workspace, "checks", []) if c.config.get("compare_knob")}
        # see CALIBRATION_PREFIX: an injected slowdown is not a tuning knob
        knobs = {name: workspace.knobs[name] for name in sorted(workspace.knobs)
                 if not is_calibration(workspace.knobs[name]) and name not in compared}
        self._ranges = build_ranges(knobs, workspace.machine_limits(), typical=not self.blind)
        self._dists = {name: r.distribution() for name, r in self._ranges.items()}

    def _new_study(self) -> optuna.Study:
        assert self._objective is not None
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.n_startup_trials)
        self._scores = PairedScores(self._objective)
        higher = self._objective.direction == "higher"
        return optuna.create_study(direction="maximize" if higher else "minimize", sampler=sampler)

    def _flush(self) -> None:
        if self._workspace is None or self._objective is None:
            return
        if self._study is None:
            self._study = self._new_study()
        backlog, self._backlog = self._backlog, []
        for exp in backlog:
            self._take(exp)

    def _objective_met(self, gates: list[GateResult]) -> bool:
        """The current objective's gate passes now, so another failing gate may take over."""
        assert self._objective is not None
        for g in gates:
            spec = g.spec if g.kind in ("absolute", "relative") else None
            if spec and spec.metric == self._objective.metric and spec.scenario == self._objective.scenario:
                return g.outcome == "pass"
        return False

    def _switch(self, objective: Objective) -> None:
        """A new metric: rebuild the study from every experiment, valued by the new metric."""
        self._objective = objective
        self._study = None
        self._pending = None
        self._backlog = self._experiments + self._backlog
        self._experiments, self._seen, self._records, self._scores = [], set(), [], None
        self._space.restart(f"objective is now {objective.metric} ({objective.source})")

    def _defaults(self) -> dict[str, Any]:
        return self._cand.clean({k: knob.default for k, knob in self._workspace.knobs.items() if knob.default is not None})

    def _config_of(self, exp: Experiment) -> dict[str, Any]:
        if exp.knobs:
            return self._cand.clean(exp.knobs)
        parent = self._configs.get(exp.parent) if exp.parent else None
        return self._cand.clean({**(parent if parent is not None else self._defaults()), **exp.change.knobs})

    def _best_config(self, state: LoopState) -> dict[str, Any]:
        if state.best.knobs:
            return self._cand.clean(state.best.knobs)
        return self._configs.get(state.best.id) or self._defaults()

    def _tell(self, trial: Trial, value: float | None) -> None:
        assert self._study is not None
        if value is None:
            self._study.tell(trial, state=TrialState.FAIL)
        else:
            self._study.tell(trial, value)

    def _take(self, exp: Experiment) -> None:
        """Record one finished experiment: tell its trial, or add it as a finished trial."""
        assert self._study is not None and self._objective is not None
        if exp.id in self._seen or not exp.finished or exp.role in ("confirm", "diagnose"):
            return  # an interrupted experiment runs again and is taken then; a confirmation or a look-again repeats the best
        self._seen.add(exp.id)
        self._experiments.append(exp)
        config = self._config_of(exp)
        self._configs[exp.id] = config
        pending = self._pending if self._pending and exp.change.key() == self._pending.change_key else None
        assert self._scores is not None
        value = self._scores.take(exp)  # also for a code change: its score is the next experiments' parent score
        if exp.change.diff and exp.change.diff.strip():
            # Code changed: the knob values do not say what ran, so it is no trial of theirs.
            if pending is not None:
                self._tell(pending.trial, None)
                self._pending = None
            return
        self._cand.add(config)
        if exp.parent is not None:
            self._tried_changes.add(exp.change.key())
        active: tuple[str, ...] | None = None
        local = False
        if pending is not None:
            self._tell(pending.trial, value)
            self._pending = None
            active, local = pending.active, pending.local
        else:
            if exp.proposer == self.name and exp.parent is not None:
                active = tuple(k for k in exp.change.knobs if k in self._dists)
                stage = local_stage(exp.change.description)
                if stage is not None:  # a local move moved one knob of its stage
                    local, active = True, tuple(k for k in stage if k in self._dists) or active
            params = {}
            for k in self._dists:
                if k in config:
                    try:
                        params[k] = self._workspace.knobs[k].check(config[k])
                    except DomainError:
                        continue
            self._study.add_trial(create_trial(
                params=params,
                distributions={k: self._dist_for(k, params[k]) for k in params},
                value=value,
                state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
                user_attrs={"experiment": exp.id, **({"active": list(active)} if active is not None else {})},
            ))
        self._records.append(TrialRecord(exp.id, value, active, exp.parent, local, tuple(exp.change.knobs)))

    # ------------------------------------------------------------ the active space (search_space.py)

    def stale_trials(self) -> int:
        """This stage's trials since the best value last improved."""
        assert self._objective is not None
        return self._space.stale_trials(self._records, self._objective)

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
        return untried_points(self._dists, active, lambda values: self._cand.is_new(values, base, tried_changes))

    # ------------------------------------------------------------ ranges and local moves (search_ranges.py)

    def _dist_for(self, name: str, value: Any) -> BaseDistribution:
        """The knob's search distribution, or its whole domain's when ``value`` lies outside it
        (a default beyond the typical range or the machine bound, kept as a fixed parameter)."""
        r = self._ranges[name]
        if r.contains(value):
            return self._dists[name]
        return distribution(self._workspace.knobs[name]) or self._dists[name]

    def _attributed(self, active: tuple[str, ...]) -> list[str]:
        """The active knobs attribution ranks (score > 0), in rank order; none in a blind search."""
        if self.blind:
            return []
        ranked = [s.name for s in self._space.ranking or [] if s.score > 0]
        return [k for k in ranked if k in active]

    def _widen_ranges(self, active: tuple[str, ...], base: dict[str, Any]) -> None:
        """A ranked knob whose best value sits at its range's edge: that side of the range grows."""
        for name in self._attributed(active):
            grown = self._ranges[name].widen_at(base.get(name))
            if grown is not None:
                self._dists[name] = self._ranges[name].distribution()
                scores = {s.name: s for s in self._space.ranking or []}
                self._space.widenings.append(f"widened {grown} and attribution ranks it ({scores[name].explain()})")

    def _local_move(self, best_id: str, active: tuple[str, ...], base: dict[str, Any],
                    tried_changes: set[str]) -> tuple[Trial, dict[str, Any], bool] | None:
        """The next local move from the best (one attributed knob x2, /2 or to the next choice),
        while they pay; None once TPE should sample the active knobs jointly."""
        attributed = self._attributed(active)
        assert self._objective is not None
        if not attributed or self._space.local_moves_over(self._records, self._objective, best_id) is not None:
            return None
        moved = self._space.moved_before(self._records, best_id)
        per_knob = [[(k, v) for v in self._ranges[k].local_moves(base.get(k))] for k in attributed if k not in moved]
        # Breadth first: each knob's first move (x2, the next choice), then each one's second.
        for rank in range(2):
            for moves in per_knob:
                if rank < len(moves) and self._cand.is_new({moves[rank][0]: moves[rank][1]}, base, tried_changes):
                    name, value = moves[rank]
                    fixed = {k: base[k] for k in self._dists if k in base}
                    trial, _ = self._ask({**fixed, name: value}, active)
                    return trial, {name: value}, True
        return None

    # ------------------------------------------------------------ sampling

    def _suggest(self, trial: Trial, name: str, d: BaseDistribution) -> Any:
        value: Any
        if isinstance(d, CategoricalDistribution):
            value = trial.suggest_categorical(name, d.choices)  # type: ignore[arg-type]
        elif isinstance(d, IntDistribution):
            value = trial.suggest_int(name, d.low, d.high, log=d.log)
        else:
            assert isinstance(d, FloatDistribution)
            value = trial.suggest_float(name, d.low, d.high, log=d.log)
        return self._workspace.knobs[name].check(value)

    def _ask(self, fixed: dict[str, Any], active: tuple[str, ...]) -> tuple[Trial, dict[str, Any]]:
        assert self._study is not None
        if fixed:
            # Enqueued values are fixed parameters of the next trial: the knobs outside the
            # space stay at the best configuration's values and enter TPE's history as such.
            self._study.enqueue_trial(fixed)
        trial = self._study.ask()
        params = {k: self._suggest(trial, k, self._dist_for(k, fixed[k]) if k in fixed else self._dists[k])
                  for k in self._dists if k in active or k in fixed}
        return trial, {k: params[k] for k in active if k in params}

    def _sample(self, active: tuple[str, ...], base: dict[str, Any], tried_changes: set[str]) -> tuple[Trial, dict[str, Any]] | None:
        assert self._study is not None
        fixed = {k: base[k] for k in self._dists if k not in active and k in base}
        for _ in range(MAX_RESAMPLE):
            trial, values = self._ask(fixed, active)
            values = self._cand.effective(values, base)
            if self._cand.is_new(values, base, tried_changes):
                return trial, values
            trial.set_user_attr("repeat", True)  # or infeasible: a broken constraint, the machine, a no-op
            self._tell(trial, None)  # a repeat is never run; FAIL keeps it out of TPE's model
        untried = self._untried(active, base, tried_changes)
        if not untried:
            return None
        values = self._rng.choice(untried)
        trial, values = self._ask({**fixed, **values}, active)
        return trial, self._cand.effective(values, base)

    def _step(self, trial: Trial, values: dict[str, Any], active: tuple[str, ...], local: bool = False) -> Step:
        assert self._objective is not None
        trial.set_user_attr("active", list(active))
        trial.set_user_attr("local", local)
        self._pending = _Pending(trial, Change(knobs=values, diff=None).key(), active, local)
        space = self._space
        stage = Stage(space.ranking or [], space.stage, len(space.stages), space.widenings, self.blind)
        return search_step(self._workspace, self._objective, values, active, stage, self._ranges, trial.number, local,
                           self.min_effect)


__all__ = ["Objective", "SearchProposer", "distribution", "is_calibration", "metric_value", "objective_for", "paired_ratio"]
