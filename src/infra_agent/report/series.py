"""The best-metric-over-experiments series behind the report's secondary, absolute plot.

Context only: each point is a median of windows measured at its own time, not what its
verdict was decided on (that is the paired ratio, :mod:`infra_agent.report.decisions`).

The metric is the one of the run's main failing criterion: the first criterion gate of
``run.gates_before`` that failed, else the most common hypothesis metric.  Each
experiment contributes the median of its candidate measurement of that metric (the
one tagged with the gate's scenario when there is one); the baseline and the accepted
experiments give the best-so-far step line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from infra_agent.feedback import Measurement
from infra_agent.records import Experiment, GateResult, GateSpec, RunRecord
from infra_agent.report.fmt import fmt_num


@dataclass(frozen=True)
class Point:
    seq: int
    id: str
    value: float
    accepted: bool  # the baseline or an accepted experiment: on the best-so-far line
    status: str


@dataclass
class Series:
    metric: str = ""
    unit: str = ""
    scenario: str = ""
    direction: str = "higher"
    source: str = ""  # why this metric was chosen
    points: list[Point] = field(default_factory=list)
    target: float | None = None
    target_label: str = ""
    note: str = ""  # why there is nothing to plot

    @property
    def best(self) -> list[Point]:
        """The best-so-far line's vertices: the baseline and the accepted experiments."""
        return [p for p in self.points if p.accepted]


def _failing_criterion(gates: list[GateResult]) -> tuple[GateResult, GateSpec] | None:
    for g in gates:
        if g.kind in ("absolute", "relative") and g.outcome == "fail" and g.spec is not None:
            return g, g.spec
    return None


def _measurement(e: Experiment, metric: str, scenario: str | None) -> Measurement | None:
    if e.feedback is None:
        return None
    found = [m for m in e.feedback.measurements if m.name == metric and m.summary is not None]
    if scenario:
        tagged = [m for m in found if m.tags.get("scenario") == scenario]
        found = tagged or [m for m in found if "scenario" not in m.tags]
    return found[0] if found else None


def build_series(run: RunRecord, experiments: list[Experiment], text: Callable[[object], str]) -> Series:
    """``text`` scrubs every string that goes into the series."""
    ordered = sorted(experiments, key=lambda e: (e.seq, e.id))
    crit = _failing_criterion(run.gates_before)
    gate: GateSpec | None = None
    if crit is not None:
        g, gate = crit
        metric, scenario = gate.metric, gate.scenario
        source = f"the first failing criterion, {g.name} ({g.gate})"
    else:
        counts = Counter(e.hypothesis.metric for e in ordered)
        if not counts:
            return Series(note="No experiments and no failing criterion: nothing to plot.")
        metric = counts.most_common(1)[0][0]  # ties: the first proposed (Counter keeps insertion order)
        scenarios = Counter(e.hypothesis.scenario for e in ordered if e.hypothesis.metric == metric and e.hypothesis.scenario)
        scenario = scenarios.most_common(1)[0][0] if scenarios else None
        source = "the most common hypothesis metric (no criterion failed before the run)"

    points: list[Point] = []
    unit, better = "", None
    for e in ordered:
        m = _measurement(e, metric, scenario)
        if m is None or m.summary is None:
            continue
        unit, better = unit or m.unit, better or m.better
        on_line = e.accepted or e.parent is None or e.id == run.baseline
        points.append(Point(e.seq, text(e.id), m.summary.median, on_line, e.status))

    if gate is not None:
        direction = "higher" if gate.op in (">=", ">") else "lower"
    elif better is not None:
        direction = better
    else:
        votes = Counter(e.hypothesis.direction for e in ordered if e.hypothesis.metric == metric)
        direction = votes.most_common(1)[0][0] if votes else "higher"

    series = Series(metric=text(metric), unit=text(unit), scenario=text(scenario), direction=direction,
                    source=text(source), points=points)
    if gate is not None and crit is not None:
        kind = crit[0].kind
        base = next((p.value for p in points if p.accepted), None)
        if kind == "absolute":
            series.target, series.target_label = gate.threshold, f"criterion {gate.op} {gate.threshold:g}"
        elif base is not None:
            series.target = gate.threshold * base
            series.target_label = f"criterion {gate.op} {gate.threshold:g}× baseline = {fmt_num(series.target)}"
    if not points:
        where = f" (scenario {text(scenario)})" if scenario else ""
        series.note = (f"No experiment's feedback has a measurement of {text(metric)}{where}; "
                       "nothing to plot.")
    return series
