"""Two values of one knob, compared on interleaved windows: the pure half of the timeline
probe's ``compare_knob`` (which values, the per-pair ratios, the interval and the gate).

The probe runs the windows (two servers, A B, B A, ...); everything here is arithmetic on
what they returned, so it is tested without a server.  The ratio is
``metric(values[1]) / metric(values[0])`` per interleaved pair, and its centre is the
geometric mean with a 95% t-interval on the logs (``stats.bootstrap.t_interval_log``), as
the judge summarises repeated runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback, Measurement


def fmt(v: Any) -> str:
    """A knob value as a tag writes it (``true``, not ``True``: the workspace's YAML spelling)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


@dataclass(frozen=True)
class KnobPair:
    knob: str
    values: tuple[Any, Any]  # (reference, tested)
    own: Any  # the configuration under test's value of the knob
    metric: str  # the window result key the ratio is of
    ratio_name: str  # the measurement's name

    def arm(self, side: int) -> str:
        return f"{self.knob}={fmt(self.values[side])}"

    @property
    def interval(self) -> str:
        return f"{self.arm(1)} / {self.arm(0)}"


def resolve_pair(ws: Any, knob: str, values: list[Any] | None, own_knobs: dict[str, Any], metric: str,
                 ratio_name: str | None) -> KnobPair:
    """The pair to compare, checked against the workspace: a declared knob and two values
    (a bool knob defaults to [false, true])."""
    if ws is None or knob not in ws.knobs:
        raise InfraAgentError(f"compare_knob {knob!r} is not a knob the workspace declares")
    pair = list(values) if values is not None else ([False, True] if ws.knobs[knob].type == "bool" else None)
    if pair is None or len(pair) != 2:
        raise InfraAgentError(f"compare_values for {knob!r}: expected two values [reference, tested]")
    return KnobPair(knob=knob, values=(pair[0], pair[1]), own=ws.resolve_knobs(own_knobs).get(knob), metric=metric,
                    ratio_name=ratio_name or f"{knob}_ratio")


def pair_ratios(reference: list[dict[str, Any]], tested: list[dict[str, Any]], metric: str) -> list[float]:
    """``tested / reference`` of ``metric`` per interleaved pair; a pair missing it on either side is left out."""
    ratios = []
    for a, b in zip(reference, tested, strict=True):
        va, vb = a.get(metric), b.get(metric)
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va > 0 and vb > 0:
            ratios.append(float(vb) / float(va))
    return ratios


def record_verdict(fb: Feedback, pair: KnobPair, ratios: list[float], scenario: str, min_ratio: float | None) -> None:
    """The ratio as the Feedback's first measurement, its interval and sentence in
    ``meta["compare"]``, and with ``min_ratio`` the statistic the check gates on in
    ``meta["gate"]`` (stats/statistic.py).  The gate is decided on the interval, as the judge
    decides every ratio: ``ok=False`` with ``meta["gate_failed"]`` only when the whole
    interval lies below ``min_ratio``; an interval that straddles it leaves the run ``ok``
    with the gate ``inconclusive``, and the judge pools the samples of further runs."""
    if not ratios:
        raise InfraAgentError(f"no pair of windows measured {pair.metric!r} on both {pair.knob} values")
    # scipy loads when a comparison ends, not when the probes are imported
    from infra_agent.stats.intervals import log_ratio_interval

    ci = log_ratio_interval(ratios)
    centre, low, high = ci.ratio, ci.low, ci.high
    fb.measurements.insert(0, Measurement.from_samples(pair.ratio_name, "ratio", ratios, "higher", scenario=scenario,
                                                       interval=pair.interval))
    compare = fb.meta.setdefault("compare", {})
    compare.update({"ratios": ratios, "geomean": centre, "low": low, "high": high,
                    "interval": f"95% t-interval of the geometric mean over {len(ratios)} interleaved pairs"})
    text = (f"{pair.metric} with {pair.arm(1)} is {centre:.3f}x that with {pair.arm(0)} "
            f"(95% interval {low:.3f}-{high:.3f}, {len(ratios)} interleaved pairs, scenario {scenario})")
    compare["message"] = text
    if min_ratio is None:
        return
    from infra_agent.stats.statistic import GATE_FAILED, GATE_META, decide_statistic

    stat: dict[str, Any] = {"metric": pair.ratio_name, "op": ">=", "threshold": min_ratio, "samples": list(ratios),
                            "unit": "interleaved pairs", "runs": 1}
    verdict = decide_statistic(stat)
    stat.update(outcome=verdict.outcome, value=verdict.ratio, low=verdict.low, high=verdict.high,
                message=verdict.message, more_samples=verdict.more_samples)
    fb.meta[GATE_META] = stat
    if verdict.outcome == "fail":
        fb.ok = False
        fb.error = f"{pair.ratio_name} {centre:.3f} < {min_ratio:g}: {text}"
        # A verdict on what was measured, not a failed measurement: the judge may still read
        # the windows (a hypothesis about throughput compares this side's with the other's).
        fb.meta[GATE_FAILED] = pair.ratio_name
