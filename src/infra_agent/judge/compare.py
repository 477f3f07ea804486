"""Comparing two sides' runs on a metric: the ratio B/A, its interval, and the verdict per gate.

Several runs per side give one value of the metric per run (paired when the counts
match, as an interleaved A B A B schedule produces); the interval is the judge's one
family, a t-interval on the logs of the per-pair ratios (``interval="bootstrap"`` opts in
to a percentile bootstrap).  One run per side gives no
interval and an ``inconclusive`` verdict asking for repeated interleaved runs (the
reason is in :mod:`infra_agent.judge.verdict`), unless ``per_request=True`` opts in to
a per-request bootstrap of a latency metric.  A side whose every run failed is
reported as failed rather than compared.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from infra_agent.errors import BenchmarkError
from infra_agent.serving.metrics import request_samples
from infra_agent.stats.bootstrap import RatioCI, bootstrap_ratio
from infra_agent.stats.decision import MIN_SAMPLES, Gate, GateDecision, Outcome, decide
from infra_agent.stats.intervals import paired_ratio_interval, unpaired_ratio_interval

_LATENCY_KEY = re.compile(r"^(mean|median|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")

# Fewer bootstrap replicates cannot place an interval's ends.
MIN_BOOT = 100
PER_REQUEST_LABEL = "per-request bootstrap: ignores between-run variance"


@dataclass
class MetricComparison:
    metric: str
    baseline: float | None
    candidate: float | None
    ci: RatioCI | None
    source: Literal["per-run", "per-request", "none"]
    note: str = ""
    # Sides ("A", "B") with no successful run, each with what went wrong.
    failed: dict[str, str] = field(default_factory=dict)
    # Why there is no interval although both sides ran (one run per side, ...), for the verdict.
    refusal: str = ""
    # More runs per side that would let the judge decide (with ``refusal``).
    more_runs: int | None = None

    @property
    def ratio(self) -> float | None:
        """B/A: the interval's estimate, else the ratio of the two values shown."""
        if self.ci is not None:
            return self.ci.ratio
        if self.baseline is None or self.candidate is None or self.baseline == 0:
            return None
        return self.candidate / self.baseline

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "baseline": self.baseline, "candidate": self.candidate, "ratio": self.ratio,
                "source": self.source, "note": self.note, "ci": self.ci.as_dict() if self.ci else None,
                "failed": dict(self.failed)}


@dataclass
class Comparison:
    metrics: list[MetricComparison] = field(default_factory=list)
    verdicts: list[GateDecision] = field(default_factory=list)

    @property
    def failed(self) -> dict[str, str]:
        """Sides with no successful run ("A", "B") and why."""
        out: dict[str, str] = {}
        for mc in self.metrics:
            out.update(mc.failed)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"metrics": [m.as_dict() for m in self.metrics], "verdicts": [v.__dict__ for v in self.verdicts],
                "failed": self.failed}


_SIDE = {"A": "A (baseline)", "B": "B (candidate)"}


def _ok(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r.get("ok", True) and r.get("completed", 0) > 0]


def _check_runs(runs: Sequence[Mapping[str, Any]], side: str) -> None:
    """Raise ``BenchmarkError`` for a run whose ``ok`` or ``completed`` is not what a result holds."""
    for i, r in enumerate(runs):
        if not isinstance(r, Mapping):
            raise BenchmarkError(f"{_SIDE[side]} run {i} is {type(r).__name__} {r!r}; expected a result object")
        ok = r.get("ok", True)
        if not isinstance(ok, bool):
            raise BenchmarkError(f"{_SIDE[side]} run {i}: ok is {ok!r}; expected true or false")
        done = r.get("completed", 0)
        if ok and (isinstance(done, bool) or not isinstance(done, int) or done < 0):
            raise BenchmarkError(f"{_SIDE[side]} run {i}: completed is {done!r}; expected a count of completed requests (an integer >= 0)")


def _failure(runs: Sequence[dict[str, Any]]) -> str:
    """What went wrong on a side none of whose runs succeeded."""
    if not runs:
        return "it has no runs"
    first = runs[0]
    if first.get("ok", True) is False:
        reason = f"failed with: {first.get('error') or '(no error text)'}"
    elif "completed" not in first:
        reason = "has no `completed` count (not a benchmark result)"
    else:
        errors = [e for e in first.get("errors") or [] if e]
        reason = "completed no request" + (f" (first error: {errors[0]})" if errors else "")
    if len(runs) == 1:
        return f"its only run {reason}"
    return f"none of its {len(runs)} runs succeeded; the first {reason}"


def _number(run: Mapping[str, Any], metric: str, side: str, i: int) -> float:
    value = run[metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BenchmarkError(f"{_SIDE[side]} run {i}: {metric} is {value!r}; expected a finite number")
    return float(value)


def check_options(confidence: float, n_boot: int, process_noise: float = 0.0) -> None:
    """Raise ``BenchmarkError`` for a confidence, replicate count or process noise the judge cannot use."""
    if not 0.0 < confidence < 1.0:
        raise BenchmarkError(f"confidence: expected a number between 0 and 1 (exclusive), e.g. 0.95; got {confidence!r}")
    if n_boot < MIN_BOOT:
        raise BenchmarkError(f"n_boot: expected at least {MIN_BOOT} bootstrap replicates (default 2000); got {n_boot!r}")
    if not (process_noise >= 0.0 and math.isfinite(process_noise)):
        raise BenchmarkError(f"process_noise: expected a finite number >= 0; got {process_noise!r}")


def _single_run_refusal(n_a: int, n_b: int) -> tuple[str, int]:
    """The message (and the more runs per side it takes) when a side has fewer than 2 runs."""
    more_a, more_b = max(0, MIN_SAMPLES - n_a), max(0, MIN_SAMPLES - n_b)
    counts = "one run per side" if n_a == n_b == 1 else f"{n_a} run(s) of A and {n_b} of B"
    more = f"{more_a} more each" if more_a == more_b else f"A {more_a} more, B {more_b} more"
    msg = (f"{counts}: a change cannot be told from the spread between runs, which only repeated runs show; "
           f"repeat the runs interleaved (A B A B ...) to >= {MIN_SAMPLES} per side ({more})")
    return msg, max(more_a, more_b, 1)


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
    per_request: bool = False,
    interval: Literal["t", "bootstrap"] = "t",
) -> MetricComparison:
    """B/A for one metric.  ``process_noise``: the per-process offset's spread (see
    ``bootstrap_ratio``); the restarts it is averaged over are counted from the runs'
    ``restart`` labels, which ``interleave_knobs(restarts=...)`` writes.

    ``per_request``: with one run per side, bootstrap a latency metric over the
    requests of those two runs (ignores between-run variance); without it, one run
    per side gives no interval and the verdict asks for repeated runs.

    ``interval``: ``t`` (default), the judge's one family: the geometric mean of per-pair
    ratios with a t-interval on their logs (the loop and the MCP tools decide on the same);
    ``bootstrap``, opt-in: a percentile bootstrap of the ratio of ``run_stat``s, which with
    few runs covers the truth less often than it claims (stats/intervals.py).
    """
    check_options(confidence, n_boot, process_noise)
    _check_runs(baseline_runs, "A")
    _check_runs(candidate_runs, "B")
    ok_a, ok_b = _ok(baseline_runs), _ok(candidate_runs)
    failed = {side: _failure(runs) for side, runs, ok in (("A", baseline_runs, ok_a), ("B", candidate_runs, ok_b)) if not ok}
    if failed:
        return _failed_sides(metric, ok_a, ok_b, failed)
    base, cand = _cycles(baseline_runs, candidate_runs, ok_a, ok_b)
    if not base or not cand:
        msg = "no cycle in which both A and B succeeded; repeat the pairs"
        return MetricComparison(metric, None, None, None, "none", msg, refusal=msg, more_runs=MIN_SAMPLES)
    _require_metric(metric, base, cand)
    a = [_number(r, metric, "A", i) for i, r in enumerate(base)]
    b = [_number(r, metric, "B", i) for i, r in enumerate(cand)]
    if len(base) >= 2 and len(cand) >= 2:
        return _per_run(metric, base, cand, a, b, run_stat=run_stat, confidence=confidence, n_boot=n_boot, seed=seed,
                        process_noise=process_noise, interval=interval)
    return _few_runs(metric, base, cand, a, b, confidence=confidence, n_boot=n_boot, seed=seed,
                     process_noise=process_noise, per_request=per_request)


def _failed_sides(metric: str, ok_a: Sequence[dict[str, Any]], ok_b: Sequence[dict[str, Any]],
                  failed: dict[str, str]) -> MetricComparison:
    """A side with no successful run: reported as failed, with the other side's value when it has one."""
    shown = {side: float(np.mean([_number(r, metric, side, i) for i, r in enumerate(ok)]))
             for side, ok in (("A", ok_a), ("B", ok_b)) if ok and all(metric in r for r in ok)}
    note = "; ".join(f"{_SIDE[s]} failed" for s in failed)
    return MetricComparison(metric, shown.get("A"), shown.get("B"), None, "none", note, failed=failed)


def _cycles(baseline_runs: Sequence[dict[str, Any]], candidate_runs: Sequence[dict[str, Any]],
            ok_a: list[dict[str, Any]], ok_b: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs to compare: whole cycles when the counts match, else each side's successful runs."""
    if len(baseline_runs) == len(candidate_runs):
        # Interleaved files hold run i of both sides from the same cycle: drop a failed
        # run together with its partner, or later runs would pair across cycles.
        keep = [i for i in range(len(baseline_runs)) if _ok([baseline_runs[i]]) and _ok([candidate_runs[i]])]
        return [baseline_runs[i] for i in keep], [candidate_runs[i] for i in keep]
    return ok_a, ok_b


def _require_metric(metric: str, base: Sequence[dict[str, Any]], cand: Sequence[dict[str, Any]]) -> None:
    """Raise ``BenchmarkError`` naming the first run without ``metric``, and the keys it may have meant."""
    for side, runs in (("A", base), ("B", cand)):
        missing = [i for i, r in enumerate(runs) if metric not in r]
        if missing:
            keys = sorted(k for k in runs[missing[0]] if not isinstance(runs[missing[0]][k], (list, dict)))
            close = difflib.get_close_matches(metric, keys, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; it holds {', '.join(keys[:16])}"
            raise BenchmarkError(f"metric {metric!r} is not in {_SIDE[side]} run {missing[0]}{hint}")


def _per_run(metric: str, base: Sequence[dict[str, Any]], cand: Sequence[dict[str, Any]], a: list[float],
             b: list[float], *, run_stat: str, confidence: float, n_boot: int, seed: int, process_noise: float,
             interval: Literal["t", "bootstrap"]) -> MetricComparison:
    """Two or more runs per side: the interval of B/A over the runs' values."""
    paired = len(a) == len(b)
    restarts = _restarts(base, cand)
    if interval == "bootstrap" or min(a + b) <= 0:
        # Opt-in (or values with no logarithm): the percentile bootstrap of the ratio of ``run_stat``s.
        ci = bootstrap_ratio(b, a, stat=run_stat, confidence=confidence, n_boot=n_boot, seed=seed, paired=paired,
                             process_noise=process_noise, restarts=restarts)
        note = f"bootstrap of the {run_stat} of {len(a)}+{len(b)} runs" + (", paired" if paired else "")
        shown = (float(np.mean(a)), float(np.mean(b))) if run_stat == "mean" else (float(np.median(a)), float(np.median(b)))
    else:
        # The judge's one family (stats/intervals.py): per-pair log ratios, t-interval.
        how = paired_ratio_interval if paired else unpaired_ratio_interval
        ci = how(b, a, confidence=confidence, process_noise=process_noise, restarts=restarts)
        note = (f"geometric mean of {len(a)} per-pair ratios, t-interval" if paired
                else f"ratio of geometric means of {len(a)}+{len(b)} runs, Welch t-interval")
        shown = (_geomean(a), _geomean(b))
    if process_noise > 0:
        note += f", process noise {process_noise:.2%} over {restarts} restart(s)"
    return MetricComparison(metric, shown[0], shown[1], ci, "per-run", note)


def _few_runs(metric: str, base: Sequence[dict[str, Any]], cand: Sequence[dict[str, Any]], a: list[float],
              b: list[float], *, confidence: float, n_boot: int, seed: int, process_noise: float,
              per_request: bool) -> MetricComparison:
    """Fewer than two runs on a side: no interval and the refusal, unless ``per_request``
    bootstraps a latency metric over the requests of one run per side."""
    refusal, more = _single_run_refusal(len(base), len(cand))
    m = _LATENCY_KEY.match(metric)
    if len(base) == 1 and len(cand) == 1:
        if per_request and m:
            stat, base_metric = m.group(1), m.group(2)
            try:
                sa, sb = request_samples(base[0], base_metric), request_samples(cand[0], base_metric)
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise BenchmarkError(f"the per-request lists ({base_metric}) of a result are missing or malformed "
                                     f"({type(exc).__name__}: {exc}); --per-request needs them") from None
            if sa and sb:
                ci = bootstrap_ratio(sb, sa, stat=stat, confidence=confidence, n_boot=n_boot, seed=seed,
                                     process_noise=process_noise)
                return MetricComparison(metric, a[0], b[0], ci, "per-request",
                                        f"{stat} of {len(sa)}+{len(sb)} per-request {base_metric} samples; {PER_REQUEST_LABEL}",
                                        refusal=refusal, more_runs=more)
        if per_request:
            refusal += "; a per-request bootstrap covers latency metrics only"
        note = f"one run per side: no interval (repeat interleaved runs, >= {MIN_SAMPLES} per side)"
    else:
        note = f"{len(base)}+{len(cand)} runs: no interval (>= {MIN_SAMPLES} per side)"
    return MetricComparison(metric, float(np.mean(a)), float(np.mean(b)), None, "none", note, refusal=refusal, more_runs=more)


def _geomean(values: Sequence[float]) -> float:
    with np.errstate(over="ignore"):
        return float(np.exp(np.mean(np.log(np.asarray(values, dtype=np.float64)))))


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
    comp.verdicts = [_verdict(g, by_name[g.metric]) for g in gates]
    return comp


def _verdict(gate: Gate, mc: MetricComparison) -> GateDecision:
    if mc.failed:
        why = "; ".join(f"{_SIDE[s]} failed: {reason}" for s, reason in mc.failed.items())
        # A candidate that produced nothing fails any gate; a failed baseline decides nothing.
        outcome: Outcome = "fail" if "A" not in mc.failed else "inconclusive"
        return GateDecision(str(gate), outcome, None, None, None, None, why)
    if mc.ci is None and mc.refusal:
        return GateDecision(str(gate), "inconclusive", mc.ratio, None, None, mc.more_runs, mc.refusal)
    v = decide(gate, mc.ci)
    if mc.source == "per-request":
        # The requests of one run share its process, its warm-up and the machine's minute:
        # they are not independent samples of the server, so their interval describes this
        # pair of runs and decides nothing (an A/A pair of single runs "failed" at
        # [1.15, 1.78] this way).  Runs are the unit: the verdict asks for them.
        where = "" if v.low is None or v.high is None else f" [{v.low:.4f}, {v.high:.4f}]"
        return GateDecision(v.gate, "inconclusive", v.ratio, v.low, v.high, mc.more_runs,
                       f"the per-request interval{where} describes these two runs only ({PER_REQUEST_LABEL}); "
                       f"{mc.refusal}" if mc.refusal else f"({PER_REQUEST_LABEL})")
    return v


__all__ = ["MIN_BOOT", "PER_REQUEST_LABEL", "Comparison", "MetricComparison", "check_options", "compare_metric",
           "compare_runs"]
