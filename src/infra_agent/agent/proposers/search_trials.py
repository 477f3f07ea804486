"""The search proposer's Optuna study, kept as a function of the experiments it has seen.

Every finished experiment is taken once, in order: its configuration counts as tried, its
paired score (``search_objective.PairedScores``) is told to the trial that proposed it, and
an experiment no trial of this study proposed (the baseline, another proposer's, one of a
resumed run) is added as a finished trial (``study.add_trial``), so that a resumed run
neither loses nor repeats a finished trial.  This bookkeeping is one idea apart from how
the proposer chooses its next move: the proposer asks and tells through it, and reads
its records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import Trial, TrialState, create_trial

from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search_candidates import Candidates
from infra_agent.agent.proposers.search_knobs import SearchKnobs
from infra_agent.agent.proposers.search_objective import Objective, PairedScores
from infra_agent.agent.proposers.search_space import TrialRecord
from infra_agent.agent.proposers.search_step import local_stage
from infra_agent.records import Experiment
from infra_agent.workspace.knobs import DomainError


@dataclass
class PendingTrial:
    """A trial proposed as a step and not yet observed."""

    trial: Trial
    change_key: str
    active: tuple[str, ...]
    local: bool = False


class TrialBook:
    """The study, the experiments it has taken, and the configurations they ran."""

    def __init__(self, proposer: str, knobs: SearchKnobs, seed: int, n_startup_trials: int) -> None:
        self.proposer = proposer  # the proposer's name: its own experiments are its trials
        self.knobs = knobs
        self.seed = seed
        self.n_startup_trials = n_startup_trials
        self.objective: Objective | None = None
        self.study: optuna.Study | None = None
        self.scores: PairedScores | None = None
        self.backlog: list[Experiment] = []  # seen before the study could take them
        self.experiments: list[Experiment] = []  # every finished experiment taken, in order
        self.seen: set[str] = set()
        self.configs: dict[str, dict[str, Any]] = {}  # experiment id -> the knob values it ran
        self.records: list[TrialRecord] = []
        self.cand = Candidates(None)  # the tried configurations, and what a new one must pass (search_candidates.py)
        self.tried_changes: set[str] = set()
        self.pending: PendingTrial | None = None

    def best_value(self) -> float | None:
        values = [r.value for r in self.records if r.value is not None]
        if not values or self.objective is None:
            return None
        return max(values) if self.objective.direction == "higher" else min(values)

    # ------------------------------------------------------------ the study

    def _new_study(self) -> optuna.Study:
        assert self.objective is not None
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=self.n_startup_trials)
        self.scores = PairedScores(self.objective)
        higher = self.objective.direction == "higher"
        return optuna.create_study(direction="maximize" if higher else "minimize", sampler=sampler)

    def flush(self) -> None:
        """Take the backlog, once the workspace and the objective are known."""
        if self.knobs.workspace is None or self.objective is None:
            return
        if self.study is None:
            self.study = self._new_study()
        backlog, self.backlog = self.backlog, []
        for exp in backlog:
            self._take(exp)

    def switch(self, objective: Objective) -> None:
        """A new metric: the study is rebuilt from every experiment, valued by the new metric."""
        self.objective = objective
        self.study = None
        self.pending = None
        self.backlog = self.experiments + self.backlog
        self.experiments, self.seen, self.records, self.scores = [], set(), [], None

    def tell(self, trial: Trial, value: float | None) -> None:
        assert self.study is not None
        if value is None:
            self.study.tell(trial, state=TrialState.FAIL)
        else:
            self.study.tell(trial, value)

    def drop_pending(self) -> None:
        """Proposed but never observed: the loop dropped it.  It stays tried."""
        if self.pending is not None:
            self.tell(self.pending.trial, None)
            self.tried_changes.add(self.pending.change_key)
            self.pending = None

    def ask(self, fixed: dict[str, Any], active: tuple[str, ...]) -> tuple[Trial, dict[str, Any]]:
        """A new trial, with ``fixed`` enqueued and ``active`` sampled: the active knobs' values."""
        assert self.study is not None
        if fixed:
            # Enqueued values are fixed parameters of the next trial: the knobs outside the
            # space stay at the best configuration's values and enter TPE's history as such.
            self.study.enqueue_trial(fixed)
        trial = self.study.ask()
        knobs = self.knobs
        params = {k: knobs.suggest(trial, k, knobs.dist_for(k, fixed[k]) if k in fixed else knobs.dists[k])
                  for k in knobs.dists if k in active or k in fixed}
        return trial, {k: params[k] for k in active if k in params}

    # ------------------------------------------------------------ configurations

    def _defaults(self) -> dict[str, Any]:
        return self.cand.clean({k: knob.default for k, knob in self.knobs.workspace.knobs.items() if knob.default is not None})

    def _config_of(self, exp: Experiment) -> dict[str, Any]:
        if exp.knobs:
            return self.cand.clean(exp.knobs)
        parent = self.configs.get(exp.parent) if exp.parent else None
        return self.cand.clean({**(parent if parent is not None else self._defaults()), **exp.change.knobs})

    def best_config(self, state: LoopState) -> dict[str, Any]:
        if state.best.knobs:
            return self.cand.clean(state.best.knobs)
        return self.configs.get(state.best.id) or self._defaults()

    # ------------------------------------------------------------ taking an experiment

    def _take(self, exp: Experiment) -> None:
        """Record one finished experiment: tell its trial, or add it as a finished trial."""
        assert self.study is not None and self.objective is not None
        if exp.id in self.seen or not exp.finished or exp.role in ("confirm", "diagnose"):
            return  # an interrupted experiment runs again and is taken then; a confirmation or a look-again repeats the best
        self.seen.add(exp.id)
        self.experiments.append(exp)
        config = self._config_of(exp)
        self.configs[exp.id] = config
        pending = self.pending if self.pending and exp.change.key() == self.pending.change_key else None
        assert self.scores is not None
        value = self.scores.take(exp)  # also for a code change: its score is the next experiments' parent score
        if exp.change.diff and exp.change.diff.strip():
            # Code changed: the knob values do not say what ran, so it is no trial of theirs.
            if pending is not None:
                self.tell(pending.trial, None)
                self.pending = None
            return
        self.cand.add(config)
        if exp.parent is not None:
            self.tried_changes.add(exp.change.key())
        active: tuple[str, ...] | None = None
        local = False
        if pending is not None:
            self.tell(pending.trial, value)
            self.pending = None
            active, local = pending.active, pending.local
        else:
            active, local = self._add_finished_trial(exp, config, value)
        self.records.append(TrialRecord(exp.id, value, active, exp.parent, local, tuple(exp.change.knobs)))

    def _add_finished_trial(self, exp: Experiment, config: dict[str, Any],
                            value: float | None) -> tuple[tuple[str, ...] | None, bool]:
        """Add an experiment no pending trial proposed as a finished trial: the knobs searched
        in it (None when it is not this proposer's trial), and whether it was a local move."""
        assert self.study is not None
        active: tuple[str, ...] | None = None
        local = False
        dists = self.knobs.dists
        if exp.proposer == self.proposer and exp.parent is not None:
            active = tuple(k for k in exp.change.knobs if k in dists)
            stage = local_stage(exp.change.description)
            if stage is not None:  # a local move moved one knob of its stage
                local, active = True, tuple(k for k in stage if k in dists) or active
        params = {}
        for k in dists:
            if k in config:
                try:
                    params[k] = self.knobs.workspace.knobs[k].check(config[k])
                except DomainError:
                    continue
        self.study.add_trial(create_trial(
            params=params,
            distributions={k: self.knobs.dist_for(k, params[k]) for k in params},
            value=value,
            state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
            user_attrs={"experiment": exp.id, **({"active": list(active)} if active is not None else {})},
        ))
        return active, local


__all__ = ["PendingTrial", "TrialBook"]
