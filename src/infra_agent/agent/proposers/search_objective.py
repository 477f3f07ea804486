"""The search proposer's objective and space: which gate it optimises, how a trial is scored
(:class:`PairedScores`: the candidate against its interleaved parent, never a bare absolute
value), how a metric is read from Feedback, and which Optuna distribution each knob gets."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from infra_agent.feedback import Feedback, Measurement
from infra_agent.judge.gates import side_values
from infra_agent.records import Direction, Experiment, GateResult
from infra_agent.workspace.knobs import LOG_RATIO, Knob  # noqa: F401  (LOG_RATIO: re-exported from its old home)
from infra_agent.workspace.models import metric_direction

CALIBRATION_PREFIX = "calibration only"
_STAT = re.compile(r"^(mean|median|std|p(\d+(?:\.\d+)?))_(ttft|tpot|itl|e2el)_ms$")


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: Direction
    scenario: str | None = None
    source: str = field(default="", compare=False)  # the gate or criterion it came from
    # The workspace check whose statistic this is (``kv_transfer_prefill_ratio`` of check
    # ``kv-transfer-prefill-ratio``): every trial runs that check on both sides (plan mode pair).
    check: str | None = None

    def better(self, a: float, b: float, margin: float = 0.0) -> bool:
        """``a`` beats ``b`` by more than ``margin`` (relative to ``|b|``)."""
        slack = margin * abs(b)
        return a > b + slack if self.direction == "higher" else a < b - slack


def _direction(metric: str, op: str | None) -> Direction:
    known = metric_direction(metric)
    if known is not None:
        return known
    return "higher" if op in (">=", ">") else "lower"


def objective_for(workspace: Any, gates: Iterable[GateResult]) -> Objective | None:
    """The first gate's statistic that does not pass (fail or inconclusive); else the first
    criterion; else output throughput.

    Such a gate is a criterion (``p90_ttft_ms <= 400 @chat``) or a check that gates on a
    statistic (``kv_transfer_prefill_ratio >= 0.95`` of check ``kv-transfer-prefill-ratio``):
    the search optimises what fails, not a guard beside it that the right change barely moves.
    A check that failed without a statistic (a crash, a correctness error) gives no number to
    optimise and is skipped."""
    for g in gates:
        spec = g.spec
        # Inconclusive is not passing either: the baseline's check read 0.82 [0.67, 1.01] against
        # 0.95 on a busy machine, and the run goes on until that gate passes.
        if g.outcome not in ("fail", "inconclusive") or spec is None:
            continue
        if g.kind in ("absolute", "relative"):
            return Objective(spec.metric, _direction(spec.metric, spec.op), spec.scenario, source=g.gate)
        if g.kind == "check" and spec.check and any(c.name == spec.check for c in workspace.checks):
            return Objective(spec.metric, "higher" if spec.op in (">=", ">") else "lower", None, source=g.gate,
                             check=spec.check)
    for c in workspace.criteria:
        return Objective(c.metric, _direction(c.metric, c.op), c.scenario, source=f"criterion {c.name}")
    if workspace.scenarios:
        return Objective("output_throughput", "higher", next(iter(workspace.scenarios)), source="no criteria")
    return None


# The smallest minimum effect a step toward a gate gets: below it the sample plan's cap
# decides nothing at the noise of a shared machine, and a 1% effect is about what a
# serving metric's pairs resolve.
LACK_FLOOR = 0.01


def step_min_effect(gates: Iterable[GateResult], objective: Objective, default: float) -> float:
    """The minimum effect of a search step toward ``objective``: ``default``, or what its gate
    still lacks when that is less (never below :data:`LACK_FLOOR`).

    After the right change, case B's check read 0.925 [0.904, 0.947] against ``>= 0.95`` on a
    busy host: the gate lacked 2.7%, and a step that raised the ratio 2.5% [0.9%, 4.2%] was
    refuted against a fixed 5%, so the run ended with the gate failing.  The effect worth
    having is the one that closes the gate: ``threshold / estimate - 1`` (``estimate /
    threshold - 1`` for a lower-is-better metric).  An inconclusive gate whose estimate
    already clears its threshold lacks samples, not effect: the floor."""
    for g in gates:
        spec = g.spec
        if g.outcome not in ("fail", "inconclusive") or spec is None or spec.metric != objective.metric:
            continue
        if (spec.check or None) != objective.check or (objective.check is None and spec.scenario != objective.scenario):
            continue
        if g.value is None or g.value <= 0 or spec.threshold <= 0 or spec.kind not in ("absolute", "relative", "check"):
            return default
        lack = spec.threshold / g.value - 1 if spec.higher else g.value / spec.threshold - 1
        return min(default, max(LACK_FLOOR, lack))
    return default


def _find(feedback: Feedback, name: str, scenario: str | None) -> Measurement | None:
    """The measurement of ``scenario``; else one without a scenario tag (as the judge reads it)."""
    named = [m for m in feedback.measurements if m.name == name]
    for m in named:
        if scenario is None or m.tags.get("scenario") == scenario:
            return m
    return next((m for m in named if "scenario" not in m.tags), None)


def _mean(samples: list[float]) -> float | None:
    finite = [s for s in samples if math.isfinite(s)]
    return float(np.mean(finite)) if finite else None


def _from_results(feedback: Feedback, metric: str, scenario: str | None) -> float | None:
    """A result key (e.g. ``total_token_throughput``) from the probe's result JSON files."""
    values = []
    for a in feedback.artifacts:
        if a.kind != "result":
            continue
        if scenario is not None and not (a.description.startswith(f"{scenario} run")
                                         or re.fullmatch(rf"serving-{re.escape(scenario)}-\d+\.json", Path(a.path).name)):
            continue
        try:
            data = json.loads(Path(a.path).read_text())
        except (OSError, ValueError):
            continue
        v = data.get(metric) if isinstance(data, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            values.append(float(v))
    return float(np.median(values)) if values else None


def metric_value(feedback: Feedback | None, metric: str, scenario: str | None = None) -> float | None:
    """The value of ``metric`` in ``scenario`` measured in ``feedback``; None when it cannot be read.

    In order: a number in ``feedback.meta`` under that name (kernel probes); a
    measurement of that name (the mean of its samples, the statistic the judge's gates
    use: one sample per measured window for throughput, pooled over a side's runs);
    a latency statistic (``p99_ttft_ms``, ``median_tpot_ms``, ``mean_itl_ms``,
    ``std_e2el_ms``) computed from the per-request samples of ``ttft_ms`` etc.; a key
    of the probe's result JSON files.  Failed feedback gives None.
    """
    if feedback is None:
        return None
    meta = feedback.meta.get(metric)
    if isinstance(meta, (int, float)) and not isinstance(meta, bool) and math.isfinite(meta):
        return float(meta)
    if not feedback.ok:
        return None
    m = _find(feedback, metric, scenario)
    if m is not None:
        return _mean(m.samples)
    stat = _STAT.match(metric)
    if stat is not None:
        m = _find(feedback, f"{stat.group(3)}_ms", scenario)
        samples = np.asarray([s for s in m.samples if math.isfinite(s)] if m is not None else [], dtype=np.float64)
        if samples.size == 0:
            return None
        kind = stat.group(1)
        if kind == "mean":
            return float(samples.mean())
        if kind == "median":
            return float(np.median(samples))
        if kind == "std":
            return float(samples.std())  # population std, as vLLM's result files give it
        return float(np.percentile(samples, float(stat.group(2))))
    return _from_results(feedback, metric, scenario)


# ---------------------------------------------------------------- the score of a trial


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def paired_ratio(candidate: Feedback | None, parent: Feedback | None, metric: str, scenario: str | None = None) -> float | None:
    """candidate / parent for ``metric``, both sides of one interleaved execution.

    The two Feedbacks hold one sample per measured window, index-paired (pair i ran side by
    side): the ratio is the geometric mean of the per-pair ratios, the judge's statistic, so
    drift shared by a pair (a quiet moment, a neighbour's burst) cancels.  Unequal counts give
    the ratio of the sides' geometric means; a metric only the pooled samples give (a
    percentile of per-request TTFTs) the ratio of the two sides' readings.  None without a
    parent side (a check-only experiment) or a positive reading on both sides.
    """
    if candidate is None or parent is None:
        return None
    b = side_values([candidate], metric, scenario)
    a = side_values([parent], metric, scenario)
    if a and b and min(a + b) > 0:
        if len(a) == len(b):
            return _geomean([bi / ai for ai, bi in zip(a, b, strict=True)])
        return _geomean(b) / _geomean(a)
    va, vb = metric_value(parent, metric, scenario), metric_value(candidate, metric, scenario)
    if va is not None and vb is not None and va > 0 and vb > 0:
        return vb / va
    return None


class PairedScores:
    """Each experiment's score on the objective, as the judge sees it: relative, paired, chained.

    The baseline scores 1.0; an experiment scores its parent's score x its paired ratio against
    the parent (:func:`paired_ratio`), so a trial run in a quiet moment, when both sides ran
    fast, is no "new best".  A ratio of a minimised metric (latency) is below 1 when it
    improves, and the study minimises it, as it would the raw metric.  An experiment without a
    parent side (a check-only experiment) falls back to its own reading, over the baseline's.

    :meth:`take` returns the value handed to Optuna: the score times the baseline's own reading
    (when it has one), so trials stay in the metric's unit and the fallback readings share it;
    a constant factor changes neither TPE's ranking nor what counts as an improvement.
    """

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        self.scale: float | None = None  # the baseline's reading of the metric
        self._scores: dict[str, float] = {}

    def score(self, exp_id: str) -> float | None:
        """The relative score of an experiment taken (the baseline's is 1.0)."""
        return self._scores.get(exp_id)

    def take(self, exp: Experiment) -> float | None:
        if exp.status != "done":
            return None
        metric, scenario, check = self.objective.metric, self.objective.scenario, self.objective.check
        # A check's statistic is read from the check's own run: the baseline's and any
        # experiment's cheap gates (``exp.checks``); a trial of the check ran it on both sides.
        reading = metric_value(exp.checks.get(check) if check else exp.feedback, metric, scenario)
        if exp.parent is None:
            self._scores[exp.id] = 1.0
            if self.scale is None and reading is not None and reading > 0:
                self.scale = reading
            return reading
        on_both_sides = check is None or (exp.probe is not None and exp.probe.check == check)
        ratio = paired_ratio(exp.feedback, exp.baseline_feedback, metric, scenario) if on_both_sides else None
        parent = self._scores.get(exp.parent)
        if ratio is not None and parent is not None:
            self._scores[exp.id] = parent * ratio
            return parent * ratio * (self.scale or 1.0)
        if reading is not None and self.scale:
            self._scores[exp.id] = reading / self.scale
        return reading


# ---------------------------------------------------------------- the space


def is_calibration(knob: Knob) -> bool:
    return knob.help.strip().lower().startswith(CALIBRATION_PREFIX)


def distribution(knob: Knob) -> BaseDistribution | None:
    """The Optuna distribution of a knob's domain; None when it cannot be searched.

    Numeric knobs need both bounds; ``str`` knobs have no domain to search.  Ints and
    floats are sampled log-uniformly by the knob's ``scale`` (by default when they span a
    ratio of ``LOG_RATIO`` or more from a positive minimum).  A domain of one value is not
    searched.  This is the whole domain; the search samples inside a knob's typical range and
    machine bound first (``search_ranges.py``).
    """
    if knob.type == "bool":
        return CategoricalDistribution([False, True])
    if knob.type == "choice":
        assert knob.choices is not None
        return CategoricalDistribution(list(knob.choices)) if len(knob.choices) > 1 else None
    if knob.type not in ("int", "float") or knob.min is None or knob.max is None:
        return None
    if knob.type == "int":
        lo, hi = math.ceil(knob.min), math.floor(knob.max)
        if lo >= hi:
            return None
        return IntDistribution(lo, hi, log=knob.log_scale)
    lo_f, hi_f = float(knob.min), float(knob.max)
    if lo_f >= hi_f:
        return None
    return FloatDistribution(lo_f, hi_f, log=knob.log_scale)
