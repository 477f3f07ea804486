"""From samples to verdicts: each gate ends as ``pass``, ``fail`` or ``inconclusive``.

A gate compares the candidate with the baseline as a ratio (``output_throughput>=0.95``
means "candidate throughput is at least 95% of baseline").  It passes when the whole
confidence interval of the ratio satisfies it, fails when the whole interval violates
it, and is inconclusive otherwise.  An inconclusive verdict does not guess: it
estimates how many more samples (pairs of runs, or requests) would shrink the
interval enough to decide, assuming the width falls as 1/√n and the estimate holds.

Samples come from a result file in two ways:
- several runs per side: one value of the metric per run (paired when the counts match,
  as an interleaved A B A B schedule produces);
- one run per side: the per-request samples of a latency metric (ttft, tpot, itl,
  e2el).  Throughput has no per-request samples, so one run per side cannot give it an
  interval; the verdict then asks for repeated runs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from infra_agent.bench.metrics import LATENCY_METRICS, request_samples
from infra_agent.errors import BenchmarkError
from infra_agent.judge.bootstrap import RatioCI, bootstrap_ratio

Op = Literal[">=", "<=", ">", "<"]
Outcome = Literal["pass", "fail", "inconclusive"]

_GATE = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<)\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")
_LATENCY_KEY = re.compile(r"^(mean|median|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


@dataclass(frozen=True)
class Gate:
    """``metric op threshold`` on the candidate/baseline ratio."""

    metric: str
    op: Op
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"


def parse_gate(text: str) -> Gate:
    m = _GATE.match(text)
    if not m:
        raise BenchmarkError(f"cannot read criterion {text!r}; expected METRIC OP RATIO, e.g. 'output_throughput>=0.95'")
    return Gate(metric=m.group(1), op=m.group(2), threshold=float(m.group(3)))  # type: ignore[arg-type]


def gate_from_criterion(criterion: Any) -> Gate:
    """A relative workspace ``Criterion`` (``ratio`` set) as a gate."""
    if criterion.ratio is None:
        raise BenchmarkError(f"criterion {criterion.name!r} is absolute (value={criterion.value}); the judge compares ratios")
    return Gate(metric=criterion.metric, op=criterion.op, threshold=float(criterion.ratio))


@dataclass(frozen=True)
class Verdict:
    gate: str
    outcome: Outcome
    ratio: float | None
    low: float | None
    high: float | None
    # For inconclusive: how many more samples (of the kind the interval used) would
    # likely decide it; None when the estimate sits on the threshold or no CI exists.
    more_samples: int | None = None
    message: str = ""


# Below this many samples per side a bootstrap has too few distinct resamples for its
# interval to carry a 95% meaning (with 2, it is about the range of the two values).
MIN_SAMPLES = 3


def decide(gate: Gate, ci: RatioCI | None) -> Verdict:
    if ci is None or not (math.isfinite(ci.low) and math.isfinite(ci.high)):
        return Verdict(str(gate), "inconclusive", None if ci is None else ci.ratio, None, None, None,
                       f"no confidence interval: repeat the runs (interleaved) so each side has >= {MIN_SAMPLES}")
    if ci.n < MIN_SAMPLES:
        more = max(MIN_SAMPLES - ci.n, more_samples_needed(ci, gate.threshold) or 0)
        return Verdict(str(gate), "inconclusive", ci.ratio, ci.low, ci.high, more,
                       f"only {ci.n} sample(s) per side; an interval needs >= {MIN_SAMPLES} to decide anything")
    lower_bound = gate.op in (">=", ">")
    # The side of the interval that faces the threshold decides.
    strict = gate.op in (">", "<")
    if lower_bound:
        passed = ci.low > gate.threshold if strict else ci.low >= gate.threshold
        failed = ci.high <= gate.threshold if strict else ci.high < gate.threshold
    else:
        passed = ci.high < gate.threshold if strict else ci.high <= gate.threshold
        failed = ci.low >= gate.threshold if strict else ci.low > gate.threshold
    if passed or failed:
        outcome: Outcome = "pass" if passed else "fail"
        msg = f"{ci.confidence:.0%} CI [{ci.low:.4f}, {ci.high:.4f}] lies {'inside' if passed else 'outside'} {gate}"
        return Verdict(str(gate), outcome, ci.ratio, ci.low, ci.high, None, msg)
    return Verdict(str(gate), "inconclusive", ci.ratio, ci.low, ci.high, more_samples_needed(ci, gate.threshold),
                   f"{ci.confidence:.0%} CI [{ci.low:.4f}, {ci.high:.4f}] straddles {gate.threshold:g}")


def more_samples_needed(ci: RatioCI, threshold: float) -> int | None:
    distance = abs(ci.ratio - threshold)
    if distance < 1e-12:
        return None
    # The half of the interval between the estimate and the threshold must shrink
    # below `distance`; width ~ 1/sqrt(n).
    half = (ci.ratio - ci.low) if ci.ratio > threshold else (ci.high - ci.ratio)
    n_needed = ci.n * (half / distance) ** 2
    return max(1, math.ceil(n_needed - ci.n))


@dataclass
class MetricComparison:
    metric: str
    baseline: float | None
    candidate: float | None
    ci: RatioCI | None
    source: Literal["per-run", "per-request", "none"]
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "baseline": self.baseline, "candidate": self.candidate, "source": self.source,
                "note": self.note, "ci": self.ci.as_dict() if self.ci else None}


@dataclass
class Comparison:
    metrics: list[MetricComparison] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"metrics": [m.as_dict() for m in self.metrics], "verdicts": [v.__dict__ for v in self.verdicts]}


def _ok(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r.get("ok", True) and r.get("completed", 0) > 0]


def compare_metric(
    baseline_runs: Sequence[dict[str, Any]],
    candidate_runs: Sequence[dict[str, Any]],
    metric: str,
    *,
    run_stat: str = "mean",
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
    process_noise: float = 0.0,
) -> MetricComparison:
    """B/A for one metric.  ``process_noise``: the per-process offset's spread (see
    ``bootstrap_ratio``); the restarts it is averaged over are counted from the runs'
    ``restart`` labels, which ``interleave_knobs(restarts=...)`` writes."""
    if len(baseline_runs) == len(candidate_runs):
        # Interleaved files hold run i of both sides from the same cycle: drop a failed
        # run together with its partner, or later runs would pair across cycles.
        keep = [i for i in range(len(baseline_runs)) if _ok([baseline_runs[i]]) and _ok([candidate_runs[i]])]
        base, cand = [baseline_runs[i] for i in keep], [candidate_runs[i] for i in keep]
    else:
        base, cand = _ok(baseline_runs), _ok(candidate_runs)
    if not base or not cand:
        return MetricComparison(metric, None, None, None, "none", "a side has no successful run")
    if any(metric not in r for r in base + cand):
        raise BenchmarkError(f"metric {metric!r} is not in every result; known keys include {sorted(k for k in base[0] if not isinstance(base[0][k], list))[:12]}")
    if len(base) >= 2 and len(cand) >= 2:
        a = [float(r[metric]) for r in base]
        b = [float(r[metric]) for r in cand]
        paired = len(a) == len(b)
        restarts = _restarts(base, cand)
        ci = bootstrap_ratio(b, a, stat=run_stat, confidence=confidence, n_boot=n_boot, seed=seed, paired=paired,
                             process_noise=process_noise, restarts=restarts)
        note = f"{run_stat} of {len(a)}+{len(b)} runs" + (", paired" if paired else "")
        if process_noise > 0:
            note += f", process noise {process_noise:.2%} over {restarts} restart(s)"
        return MetricComparison(metric, float(np.mean(a)) if run_stat == "mean" else float(np.median(a)),
                                float(np.mean(b)) if run_stat == "mean" else float(np.median(b)), ci, "per-run", note)
    m = _LATENCY_KEY.match(metric)
    if len(base) == 1 and len(cand) == 1 and m:
        stat, base_metric = m.group(1), m.group(2)
        a, b = request_samples(base[0], base_metric), request_samples(cand[0], base_metric)
        if a and b:
            ci = bootstrap_ratio(b, a, stat=stat, confidence=confidence, n_boot=n_boot, seed=seed, process_noise=process_noise)
            return MetricComparison(metric, float(base[0][metric]), float(cand[0][metric]), ci, "per-request",
                                    f"{stat} of {len(a)}+{len(b)} per-request {base_metric} samples")
    note = "one run per side: repeat the runs (interleaved) for an interval" if len(base) == 1 or len(cand) == 1 else ""
    return MetricComparison(metric, float(np.mean([r[metric] for r in base])), float(np.mean([r[metric] for r in cand])), None, "none", note)


def _restarts(base: Sequence[dict[str, Any]], cand: Sequence[dict[str, Any]]) -> int:
    """Fresh process pairs behind the runs: distinct ``restart`` labels (1 when unlabelled)."""
    labels = {r.get("restart") for r in base} | {r.get("restart") for r in cand}
    labels.discard(None)
    return max(1, len(labels))


def compare_runs(
    baseline_runs: Sequence[dict[str, Any]],
    candidate_runs: Sequence[dict[str, Any]],
    metrics: Sequence[str],
    gates: Sequence[Gate] = (),
    **kwargs: Any,
) -> Comparison:
    """Ratio (candidate/baseline) with CI for each metric, and a verdict for each gate."""
    names = list(dict.fromkeys([*metrics, *(g.metric for g in gates)]))
    comp = Comparison(metrics=[compare_metric(baseline_runs, candidate_runs, n, **kwargs) for n in names])
    by_name = {mc.metric: mc for mc in comp.metrics}
    comp.verdicts = [decide(g, by_name[g.metric].ci) for g in gates]
    return comp


__all__ = ["LATENCY_METRICS", "Comparison", "Gate", "MetricComparison", "Verdict", "compare_metric", "compare_runs",
           "decide", "gate_from_criterion", "more_samples_needed", "parse_gate"]
