"""The knobs the search proposer may sample, and the distribution it samples each from now.

A workspace knob is searchable when it has a search range (``search_ranges.py``: bounded,
more than one value the machine allows), is no calibration knob, and is no knob a check
compares.  Its distribution is its range's, and changes only when the range grows.  This is
kept apart from the proposer because both the study's bookkeeping (a finished experiment's
parameters) and the proposer's moves read it, and neither owns it.
"""

from __future__ import annotations

from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import Trial

from infra_agent.agent.proposers.search_objective import distribution, is_calibration
from infra_agent.agent.proposers.search_ranges import KnobRange, build_ranges


class SearchKnobs:
    """The searchable knobs of one workspace: where each is sampled now, as a range and a distribution."""

    def __init__(self, blind: bool) -> None:
        self.blind = blind  # a blind search starts at each knob's whole domain, not its typical range
        self.workspace: Any = None  # set once, by ``bind``
        self.ranges: dict[str, KnobRange] = {}  # where each searchable knob is sampled now
        self.dists: dict[str, BaseDistribution] = {}  # the searchable knobs, by name (their ranges' distributions)

    def bind(self, workspace: Any) -> None:
        """Take the workspace's searchable knobs (once: a later workspace is ignored)."""
        if self.workspace is not None:
            return
        self.workspace = workspace
        # A knob a check compares (``compare_knob``: kv_transfer off vs on) is the criterion's
        # variable, set by the check on both sides: changing it in the configuration moves
        # nothing the check measures, so a trial of it would be wasted.
        compared = {str(c.config.get("compare_knob")) for c in getattr(workspace, "checks", []) if c.config.get("compare_knob")}
        # Calibration knobs (``help: Calibration only; ...``) inject an artificial slowdown
        # (a sleep per engine step, a fraction of steps lost) so the judge and the benchmarks
        # can be checked against a known effect.  They are never searched: setting them to 0
        # "wins" trivially against a calibrated baseline and tells nothing about the system,
        # and any other value only makes it slower on purpose.
        knobs = {name: workspace.knobs[name] for name in sorted(workspace.knobs)
                 if not is_calibration(workspace.knobs[name]) and name not in compared}
        self.ranges = build_ranges(knobs, workspace.machine_limits(), typical=not self.blind)
        self.dists = {name: r.distribution() for name, r in self.ranges.items()}

    def dist_for(self, name: str, value: Any) -> BaseDistribution:
        """The knob's search distribution, or its whole domain's when ``value`` lies outside it
        (a default beyond the typical range or the machine bound, kept as a fixed parameter)."""
        r = self.ranges[name]
        if r.contains(value):
            return self.dists[name]
        return distribution(self.workspace.knobs[name]) or self.dists[name]

    def widen_at(self, name: str, value: Any) -> str | None:
        """Grow ``name``'s range on the side ``value`` sits at the edge of: what grew (None: nothing)."""
        grown = self.ranges[name].widen_at(value)
        if grown is not None:
            self.dists[name] = self.ranges[name].distribution()
        return grown

    def suggest(self, trial: Trial, name: str, d: BaseDistribution) -> Any:
        """Ask ``trial`` for ``name``'s value from ``d``, as the knob parses it."""
        value: Any
        if isinstance(d, CategoricalDistribution):
            value = trial.suggest_categorical(name, d.choices)  # type: ignore[arg-type]
        elif isinstance(d, IntDistribution):
            value = trial.suggest_int(name, d.low, d.high, log=d.log)
        else:
            assert isinstance(d, FloatDistribution)
            value = trial.suggest_float(name, d.low, d.high, log=d.log)
        return self.workspace.knobs[name].check(value)


__all__ = ["SearchKnobs"]
