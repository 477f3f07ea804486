"""The ``search`` proposer: Optuna's TPE over the knob space, guided by attribution.

The objective is the metric of the first failing criterion gate of the best
configuration (``output_throughput>=300 @chat``: maximise ``output_throughput`` in
scenario ``chat``), else the workspace's first criterion.  Every trial is one
experiment: ``propose`` asks Optuna for a trial and returns it as a ``Step``;
``observe`` tells the trial the candidate's measured value (read from its
``Feedback`` by :func:`metric_value`), or marks it failed.

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
from collections.abc import Mapping
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

from infra_agent.agent.experiment import (
    Change,
    Experiment,
    GateResult,
    Hypothesis,
    Step,
)
from infra_agent.agent.proposers.attribution import KnobScore
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search_objective import (  # re-exported: callers import them from here
    Objective,
    distribution,
    is_calibration,
    metric_value,
    objective_for,
    parse_gate,
)
from infra_agent.agent.proposers.search_space import (
    StagedSpace,
    TrialRecord,
    untried_points,
)
from infra_agent.feedback import Location
from infra_agent.workspace.knobs import DomainError

# Calibration knobs (``help: Calibration only; ...``) inject an artificial slowdown
# (a sleep per engine step, a fraction of steps lost) so the judge and the benchmarks
# can be checked against a known effect.  They are never searched: setting them to 0
# "wins" trivially against a calibrated baseline and tells nothing about the system,
# and any other value only makes it slower on purpose.
MAX_RESAMPLE = 24  # samples per proposal before a repeated configuration counts as exhaustion
DEFAULT_STARTUP_TRIALS = 5  # random trials before TPE models; e2e trials are too costly for Optuna's 10

# ``metric op threshold [@scenario]``; relative gates end in `` x baseline`` (judge.gates.gate_label).


# ---------------------------------------------------------------- the objective


ConfigKey = tuple[tuple[str, str, str], ...]


def _config_key(config: Mapping[str, Any]) -> ConfigKey:
    return tuple(sorted((k, type(v).__name__, repr(v)) for k, v in config.items()))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class _Pending:
    trial: Trial
    change_key: str
    active: tuple[str, ...]


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
        self._dists: dict[str, BaseDistribution] = {}  # the searchable knobs, by name
        self._objective: Objective | None = None
        self._study: optuna.Study | None = None
        self._backlog: list[Experiment] = []  # seen before the study could take them
        self._experiments: list[Experiment] = []  # every finished experiment taken, in order
        self._seen: set[str] = set()
        self._configs: dict[str, dict[str, Any]] = {}  # experiment id -> the knob values it ran
        self._records: list[TrialRecord] = []
        self._tried: set[ConfigKey] = set()
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
            reason = None if last else self._exhausted(active, base, tried_changes)
            if reason is None:
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
        # A knob a check compares (``compare_knob``: kv_transfer off vs on) is the criterion's
        # variable, set by the check on both sides: changing it in the configuration moves
        # nothing the check measures, so a trial of it would be wasted.
        compared = {str(c.config.get("compare_knob")) for c in getattr(workspace, "checks", []) if c.config.get("compare_knob")}
        for name in sorted(workspace.knobs):
            knob = workspace.knobs[name]
            if is_calibration(knob) or name in compared:
                continue  # see CALIBRATION_PREFIX: an injected slowdown is not a tuning knob
            dist = distribution(knob)
            if dist is not None:
                self._dists[name] = dist

    def _new_study(self) -> optuna.Study:
        assert self._objective is not None
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.n_startup_trials)
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
            spec = parse_gate(g.gate) if g.kind in ("absolute", "relative") else None
            if spec and spec.metric == self._objective.metric and spec.scenario == self._objective.scenario:
                return g.outcome == "pass"
        return False

    def _switch(self, objective: Objective) -> None:
        """A new metric: rebuild the study from every experiment, valued by the new metric."""
        self._objective = objective
        self._study = None
        self._pending = None
        self._backlog = self._experiments + self._backlog
        self._experiments, self._seen, self._records = [], set(), []
        self._space.restart(f"objective is now {objective.metric} ({objective.source})")

    def _clean(self, config: Mapping[str, Any]) -> dict[str, Any]:
        out = {}
        for k, v in config.items():
            knob = self._workspace.knobs.get(k)
            if knob is not None:
                try:
                    v = knob.check(v)
                except DomainError:
                    pass
            out[k] = v
        return out

    def _defaults(self) -> dict[str, Any]:
        return self._clean({k: knob.default for k, knob in self._workspace.knobs.items() if knob.default is not None})

    def _config_of(self, exp: Experiment) -> dict[str, Any]:
        if exp.knobs:
            return self._clean(exp.knobs)
        parent = self._configs.get(exp.parent) if exp.parent else None
        return self._clean({**(parent if parent is not None else self._defaults()), **exp.change.knobs})

    def _best_config(self, state: LoopState) -> dict[str, Any]:
        if state.best.knobs:
            return self._clean(state.best.knobs)
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
        if exp.change.diff and exp.change.diff.strip():
            # Code changed: the knob values do not say what ran, nor is its value comparable.
            if pending is not None:
                self._tell(pending.trial, None)
                self._pending = None
            return
        self._tried.add(_config_key(config))
        if exp.parent is not None:
            self._tried_changes.add(exp.change.key())
        value = None
        if exp.status == "done":
            value = metric_value(exp.feedback, self._objective.metric, self._objective.scenario)
        active: tuple[str, ...] | None = None
        if pending is not None:
            self._tell(pending.trial, value)
            self._pending = None
            active = pending.active
        else:
            if exp.proposer == self.name and exp.parent is not None:
                active = tuple(k for k in exp.change.knobs if k in self._dists)
            params = {}
            for k in self._dists:
                if k in config:
                    try:
                        params[k] = self._workspace.knobs[k].check(config[k])
                    except DomainError:
                        continue
            self._study.add_trial(create_trial(
                params=params,
                distributions={k: self._dists[k] for k in params},
                value=value,
                state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
                user_attrs={"experiment": exp.id, **({"active": list(active)} if active is not None else {})},
            ))
        self._records.append(TrialRecord(exp.id, value, active))

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
        return untried_points(self._dists, active, lambda values: self._is_new(values, base, tried_changes))

    def _is_new(self, values: dict[str, Any], base: dict[str, Any], tried_changes: set[str]) -> bool:
        if _config_key(self._clean({**base, **values})) in self._tried:
            return False
        return Change(knobs=values, diff=None).key() not in tried_changes

    # ------------------------------------------------------------ sampling

    def _suggest(self, trial: Trial, name: str) -> Any:
        d = self._dists[name]
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
        params = {k: self._suggest(trial, k) for k in self._dists if k in active or k in fixed}
        return trial, {k: params[k] for k in active}

    def _sample(self, active: tuple[str, ...], base: dict[str, Any], tried_changes: set[str]) -> tuple[Trial, dict[str, Any]] | None:
        assert self._study is not None
        fixed = {k: base[k] for k in self._dists if k not in active and k in base}
        for _ in range(MAX_RESAMPLE):
            trial, values = self._ask(fixed, active)
            if self._is_new(values, base, tried_changes):
                return trial, values
            trial.set_user_attr("repeat", True)
            self._tell(trial, None)  # a repeat is never run; FAIL keeps it out of TPE's model
        untried = self._untried(active, base, tried_changes)
        if not untried:
            return None
        values = self._rng.choice(untried)
        trial, values = self._ask({**fixed, **values}, active)
        return trial, values

    def _why(self, active: tuple[str, ...]) -> str:
        if self.blind:
            return f"blind search over all {len(active)} knobs"
        scores = {s.name: s for s in self._space.ranking or []}
        parts: dict[str, None] = {}
        for k in active:
            s = scores.get(k)
            if s is not None and s.score > 0:
                for p in s.explain().split(", "):
                    parts.setdefault(p, None)
        if not parts:
            return f"no finding points at a knob: searching all {len(active)} knobs"
        why = "ranked by attribution: " + ", ".join(parts)
        if self._space.stage > 0:
            why += f"; widened to {len(active)} knobs"
        return why

    def _step(self, trial: Trial, values: dict[str, Any], active: tuple[str, ...]) -> Step:
        assert self._objective is not None
        obj = self._objective
        trial.set_user_attr("active", list(active))
        change = Change(knobs=values, diff=None)
        self._pending = _Pending(trial, change.key(), active)
        order = [s.name for s in self._space.ranking or []]
        shown = sorted(values, key=lambda k: order.index(k) if k in order else len(order))
        assignment = ", ".join(f"{k}={_show(values[k])}" for k in shown)
        top = shown[0]
        knob = self._workspace.knobs[top]
        try:
            locality = Location(component=knob.components[0] if knob.components else None, knob=top)
        except ValueError:
            locality = Location(knob=top)
        verb = "raises" if obj.direction == "higher" else "lowers"
        hypothesis = Hypothesis(
            statement=f"{assignment} {verb} {obj.metric} ({self._why(active)})",
            metric=obj.metric,
            direction=obj.direction,
            min_effect=self.min_effect,
            scenario=obj.scenario,
            locality=locality,
        )
        space = self._space
        stage = f"stage {space.stage + 1}/{len(space.stages)}: {', '.join(active)}"
        widened = f"; {space.widenings[-1]}" if space.widenings else ""
        rationale = (f"TPE trial {trial.number} ({stage}{widened}); objective {obj.metric} ({obj.direction} is better) "
                     f"from {obj.source or 'the ledger'}; knobs outside the space stay at the best configuration's values")
        return Step(hypothesis=hypothesis, change=Change(knobs=values, diff=None, description=f"search: {assignment}"),
                    probe=None, rationale=rationale)


__all__ = ["Objective", "SearchProposer", "distribution", "is_calibration", "metric_value", "objective_for", "parse_gate"]
