"""The search proposer's objective and space: which gate it optimises, how a metric is read
from Feedback, and which Optuna distribution each knob gets."""

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

from infra_agent.agent.experiment import Direction, GateResult
from infra_agent.feedback import Feedback, Measurement
from infra_agent.workspace.knobs import Knob
from infra_agent.workspace.models import metric_direction

CALIBRATION_PREFIX = "calibration only"
LOG_RATIO = 64  # numeric knobs whose max/min reaches this are sampled log-uniformly
_GATE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<)\s*([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|inf))"
                   r"\s*(?:@\s*(\S+))?\s*(?:x\s+baseline)?\s*$")
_STAT = re.compile(r"^(mean|median|std|p(\d+(?:\.\d+)?))_(ttft|tpot|itl|e2el)_ms$")


@dataclass(frozen=True)
class GateSpec:
    metric: str
    op: str
    threshold: float
    scenario: str | None


def parse_gate(text: str) -> GateSpec | None:
    """``output_throughput>=300 @chat`` (or ``p99_ttft_ms<=1.1 @chat x baseline``) -> metric, op,
    threshold, scenario; None if not that form (``check ...`` gates)."""
    m = _GATE.match(text)
    if not m:
        return None
    return GateSpec(metric=m.group(1), op=m.group(2), threshold=float(m.group(3)), scenario=m.group(4))


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: Direction
    scenario: str | None = None
    source: str = field(default="", compare=False)  # the gate or criterion it came from

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
    """The first failing criterion gate's metric; else the first criterion; else output throughput."""
    for g in gates:
        if g.outcome == "fail" and g.kind in ("absolute", "relative"):
            spec = parse_gate(g.gate)
            if spec is not None:
                return Objective(spec.metric, _direction(spec.metric, spec.op), spec.scenario, source=g.gate)
    for c in workspace.criteria:
        return Objective(c.metric, _direction(c.metric, c.op), c.scenario, source=f"criterion {c.name}")
    if workspace.scenarios:
        return Objective("output_throughput", "higher", next(iter(workspace.scenarios)), source="no criteria")
    return None


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


# ---------------------------------------------------------------- the space


def is_calibration(knob: Knob) -> bool:
    return knob.help.strip().lower().startswith(CALIBRATION_PREFIX)


def distribution(knob: Knob) -> BaseDistribution | None:
    """The Optuna distribution of a knob's domain; None when it cannot be searched.

    Numeric knobs need both bounds; ``str`` knobs have no domain to search.  Ints and
    floats spanning a ratio of ``LOG_RATIO`` or more (from a positive minimum; ints
    from 1) are sampled log-uniformly.  A domain of one value is not searched.
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
        return IntDistribution(lo, hi, log=lo >= 1 and hi / lo >= LOG_RATIO)
    lo_f, hi_f = float(knob.min), float(knob.max)
    if lo_f >= hi_f:
        return None
    return FloatDistribution(lo_f, hi_f, log=lo_f > 0 and hi_f / lo_f >= LOG_RATIO)
