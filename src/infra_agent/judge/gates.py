"""Gates and hypothesis verdicts over Feedback.

The judge reads Feedback, never raw result dicts.  A serving probe run is one
Feedback whose measurements carry one sample per measured window for every result
key (``output_throughput``, ``p99_ttft_ms`` ...), tagged with the scenario.  An
interleaved A/B is two lists of such Feedback, index-paired (pair i ran side by side).

- A **relative** criterion (``ratio``) is a gate on candidate/baseline: the interval of
  the geometric mean of the per-pair ratios must lie on its side of the threshold.
- An **absolute** criterion (``value``) is a gate on the candidate alone: the interval
  of its geometric mean over runs must lie on its side.
- A **check** (a kernel check, a unit test command) passes when its probe's Feedback
  is ok; a check that gates on a statistic (``meta["gate"]``: the kv_transfer on/off
  ratio) is decided on that statistic's interval like any ratio, and every run of the
  check in one experiment is pooled into one gate (judge/pooling.py).
- A **timing** compared across sides (a kernel bench, tier micro) counts one value per
  run, the median of its batches: the executor runs such a check in interleaved rounds
  (A B, B A, ...), and the rounds are the pairs, as windows are for a serving A/B.
- A criterion with ``check:`` (the quality probe's ``kl_div <= 0.01``) is an absolute
  gate on that check's Feedback: the interval is over its samples (one per prompt for
  the quality probe), pooled over the check's runs.
- The **hypothesis** is a ratio gate (``metric`` moves in ``direction`` by at least
  ``min_effect``): supported when the interval clears it, refuted when the interval
  lies wholly on the other side, inconclusive otherwise.  Count metrics reported by a
  check (``failed_checks``) are exact, and compared exactly.

Intervals are the judge's one family (:mod:`infra_agent.stats.intervals`): t-intervals
on the logarithms (per-pair log ratios for an A/B) at any sample size, labelled with
what they are; a percentile bootstrap of 3 to 9 values cannot reach past their range and
covers the truth far less often than it claims.  ``confidence`` is 0.95 for one look and
higher per look of a sequential design (judge/sequential.py).  Fewer than 3 runs per
side give no decision: inconclusive, with the number of runs that would decide.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from infra_agent.feedback import Feedback, Tier
from infra_agent.judge.pooling import hard_failure, statistic_of
from infra_agent.judge.process_noise import ProcessNoise, tau_for
from infra_agent.records import (
    COUNT_METRICS,
    EXACT_COUNT,
    GateResult,
    GateSpec,
    Hypothesis,
    VerdictOutcome,
)
from infra_agent.stats.bootstrap import RatioCI, bootstrap_ci
from infra_agent.stats.decision import MIN_SAMPLES, Gate, decide
from infra_agent.stats.intervals import label as interval_label
from infra_agent.stats.intervals import (
    paired_ratio_interval,
    t_interval_of_values,
    unpaired_ratio_interval,
)
from infra_agent.stats.statistic import decide_statistic

_RUN_STAT = "mean"


def side_values(feedbacks: Sequence[Feedback], metric: str, scenario: str | None = None, *,
                per_run: bool = False) -> list[float]:
    """One value per run (or per sample a probe reported) of ``metric`` on one side.

    ``per_run``: one value per run even where a run reported many samples (its median): a
    timing's samples are batches of one process at one moment, which say nothing of how
    the next run, at another moment, will read."""
    out: list[float] = []
    for fb in feedbacks:
        # A failed run's numbers are not trusted, unless it failed only a gate of its own
        # (``meta.gate_failed``: it measured, and the measurement missed a threshold).
        if not fb.ok and metric not in fb.meta and not fb.meta.get("gate_failed"):
            continue
        if metric in fb.meta and isinstance(fb.meta[metric], (int, float)):
            out.append(float(fb.meta[metric]))
            continue
        for m in fb.measurements:
            if m.name == metric and (scenario is None or m.tags.get("scenario") in (None, scenario)):
                finite = [float(s) for s in m.samples if math.isfinite(s)]
                # A record pooled over runs holds one value per run already when the counts agree.
                one_per_run = len(finite) == int(fb.meta.get("runs") or 1)
                out.extend([statistics.median(finite)] if per_run and finite and not one_per_run else finite)
                break
    return out


def gate_label(metric: str, op: str, threshold: float, scenario: str | None) -> str:
    return f"{metric}{op}{threshold:g}" + (f" @{scenario}" if scenario else "")


def _result(name: str, gate: str, spec: GateSpec, ci: RatioCI | None, interval: str, measured_in: str | None,
            absolute: bool = False) -> GateResult:
    v = decide(Gate(spec.metric, spec.op, spec.threshold), ci)
    message = v.message
    if absolute and ci is not None:
        # decide() speaks of ratios; an absolute gate's interval is of the metric itself.
        message = message.replace("CI", "CI of the geometric mean" if "geometric" in interval else "CI of the mean")
    return GateResult(name=name, gate=gate, kind=spec.kind, spec=spec, outcome=v.outcome, value=v.ratio, low=v.low,
                      high=v.high,
                      interval=interval if ci is not None else "", message=message, more_samples=v.more_samples,
                      measured_in=measured_in)


def absolute_gate(name: str, metric: str, op: str, value: float, scenario: str | None, candidate: Sequence[Feedback],
                  measured_in: str | None = None, samples: str = "run(s)", confidence: float = 0.95,
                  check: str | None = None) -> GateResult:
    vals = side_values(candidate, metric, scenario)
    label = gate_label(metric, op, value, scenario)
    spec = GateSpec(kind="absolute", metric=metric, op=op, threshold=value, scenario=scenario, check=check)  # type: ignore[arg-type]
    if not vals:
        return GateResult(name=name, gate=label, kind="absolute", spec=spec, outcome="error", measured_in=measured_in,
                          message=f"no run measured {metric}" + (f" in scenario {scenario}" if scenario else ""))
    conf = f"{confidence:.1%}".replace(".0%", "%")
    if min(vals) > 0:
        centre, low, high = t_interval_of_values(vals, confidence=confidence)
        interval = f"{conf} t-interval of the geometric mean over {len(vals)} {samples}"
    else:
        # Zeros (a KL divergence of exactly 0 on some prompts) have no logarithm: the mean's bootstrap.
        ci = bootstrap_ci(vals, stat=_RUN_STAT, confidence=confidence)
        centre, low, high = ci.value, ci.low, ci.high
        interval = f"{conf} bootstrap CI of the mean over {ci.n} {samples}"
    as_ratio = RatioCI(ratio=centre, low=low, high=high, confidence=confidence, stat=_RUN_STAT,
                       n_candidate=len(vals), n_baseline=len(vals), paired=False, n_boot=0)
    return _result(name, label, spec, as_ratio, interval, measured_in, absolute=True)


def ratio_ci(candidate: Sequence[Feedback], baseline: Sequence[Feedback], metric: str,
             scenario: str | None, confidence: float = 0.95,
             noise: ProcessNoise | None = None) -> tuple[RatioCI | None, str]:
    """Candidate/baseline with its interval and label: per-pair ratios when the run counts match
    (interleaved pairs), else the ratio of geometric means (stats/intervals.py).  ``noise``: the
    spread between fresh server processes over the batches the pairs came from
    (judge/process_noise.py), which the pairs of one batch share and cannot show."""
    # Timings (tier micro: a kernel bench) are compared run against run, never batch against batch.
    per_run = any(fb.tier == Tier.micro for fb in [*candidate, *baseline])
    b = side_values(candidate, metric, scenario, per_run=per_run)
    a = side_values(baseline, metric, scenario, per_run=per_run)
    if not a or not b or min(a + b) <= 0:
        return None, ""
    tau, restarts = tau_for(noise, metric)
    if len(a) == len(b):
        ci = paired_ratio_interval(b, a, confidence=confidence, process_noise=tau, restarts=restarts)
        return ci, interval_label(ci, f"ratio over {len(a)} interleaved pairs")
    ci = unpaired_ratio_interval(b, a, confidence=confidence, process_noise=tau, restarts=restarts)
    return ci, interval_label(ci, f"ratio over {len(a)}+{len(b)} runs (unpaired, Welch)")


def relative_gate(name: str, metric: str, op: str, ratio: float, scenario: str | None, candidate: Sequence[Feedback],
                  baseline: Sequence[Feedback], measured_in: str | None = None, confidence: float = 0.95,
                  noise: ProcessNoise | None = None) -> GateResult:
    label = gate_label(metric, op, ratio, scenario) + " x baseline"
    spec = GateSpec(kind="relative", metric=metric, op=op, threshold=ratio, scenario=scenario)  # type: ignore[arg-type]
    ci, interval = ratio_ci(candidate, baseline, metric, scenario, confidence, noise)
    if ci is None:
        return GateResult(name=name, gate=label, kind="relative", spec=spec, outcome="error", measured_in=measured_in,
                          message=f"{metric} was not measured on both sides")
    return _result(name, label, spec, ci, interval, measured_in)


def criteria_gates(workspace: Any, candidate: dict[str, list[Feedback]], baseline: dict[str, list[Feedback]] | None,
                   measured_in: str | None = None, checks: Mapping[str, Feedback] | None = None,
                   confidence: float = 0.95, noise: ProcessNoise | None = None) -> list[GateResult]:
    """Every workspace criterion whose scenario (or check) was measured; relative ones need a baseline side.

    ``checks``: the Feedback of the workspace checks run on the candidate, by check name,
    for criteria that name a ``check`` (the quality probe's metrics)."""
    out: list[GateResult] = []
    for c in workspace.criteria:
        check = getattr(c, "check", None)
        if check is not None:
            if checks is not None and check in checks and c.value is not None:
                out.append(check_criterion_gate(c.name, c.metric, c.op, float(c.value), checks[check], measured_in,
                                                confidence, check=check))
            continue
        if c.scenario not in candidate:
            continue
        if c.ratio is None:
            out.append(absolute_gate(c.name, c.metric, c.op, float(c.value), c.scenario, candidate[c.scenario], measured_in,
                                     confidence=confidence))
        elif baseline is not None and c.scenario in baseline:
            out.append(relative_gate(c.name, c.metric, c.op, float(c.ratio), c.scenario, candidate[c.scenario],
                                     baseline[c.scenario], measured_in, confidence, noise))
        else:
            out.append(self_relative_gate(c.name, c.metric, c.op, float(c.ratio), c.scenario, measured_in))
    return out


def check_criterion_gate(name: str, metric: str, op: str, value: float, fb: Feedback,
                         measured_in: str | None = None, confidence: float = 0.95,
                         check: str | None = None) -> GateResult:
    """An absolute criterion on a check's Feedback (``kl_div <= 0.01`` on the quality check).

    A check that measured nothing (a server without logprobs) is an ``error`` gate naming
    why, never a pass on missing numbers."""
    if not fb.ok and not any(m.name == metric for m in fb.measurements):
        label = gate_label(metric, op, value, None)
        spec = GateSpec(kind="absolute", metric=metric, op=op, threshold=value, check=check)  # type: ignore[arg-type]
        return GateResult(name=name, gate=label, kind="absolute", spec=spec, outcome="error", measured_in=measured_in,
                          message=f"{metric} was not measured: {fb.error or 'the check failed'}")
    unit = "prompt(s)" if fb.probe == "quality" else "sample(s)"
    return absolute_gate(name, metric, op, value, None, [fb.model_copy(update={"ok": True})], measured_in, samples=unit,
                         confidence=confidence, check=check)


def holds_on_itself(op: str, ratio: float) -> bool:
    """Whether a ratio gate holds for a configuration against itself (a ratio of exactly 1)."""
    return {">=": 1.0 >= ratio, ">": 1.0 > ratio, "<=": 1.0 <= ratio, "<": 1.0 < ratio}.get(op, False)


def self_relative_gate(name: str, metric: str, op: str, ratio: float, scenario: str | None,
                       measured_in: str | None = None) -> GateResult:
    """A relative criterion on a configuration with nothing to compare against (the baseline).

    Against itself the ratio is exactly 1: a guard (``>= 0.95``, ``<= 1.1``) holds by
    definition and is ``skipped``; a target (``>= 1.2``) fails by definition, so the run
    works towards it instead of stopping at once as if every gate passed."""
    label = gate_label(metric, op, ratio, scenario) + " x baseline"
    spec = GateSpec(kind="relative", metric=metric, op=op, threshold=ratio, scenario=scenario)  # type: ignore[arg-type]
    if holds_on_itself(op, ratio):
        return GateResult(name=name, gate=label, kind="relative", spec=spec, outcome="skipped", measured_in=measured_in,
                          message="relative to itself: holds by definition on the baseline")
    return GateResult(name=name, gate=label, kind="relative", spec=spec, outcome="fail", value=1.0, low=1.0, high=1.0,
                      interval="exact: the baseline against itself", measured_in=measured_in,
                      message=f"relative to itself the ratio is 1 by definition, which does not meet {op} {ratio:g}")


def check_gate(name: str, fb: Feedback, measured_in: str | None = None, confidence: float = 0.95) -> GateResult:
    """One check's gate from its (pooled) Feedback: ``fail`` when a run failed to measure;
    a check that gates on a statistic (``meta["gate"]``) is decided on its interval, as
    every ratio is (pass, fail or inconclusive with the samples it needs); any other check
    passes when its Feedback is ok."""
    label = f"check {name} ({fb.probe}/{fb.tier.value})"
    stat = statistic_of(fb)
    if stat is not None and not hard_failure(fb):
        v = decide_statistic(stat, confidence)
        runs = int(stat.get("runs") or fb.meta.get("runs") or 1)
        n = len(stat["samples"])
        unit = stat.get("unit") or "samples"
        conf = f"{confidence:.1%}".replace(".0%", "%")
        interval = f"{conf} t-interval of the geometric mean over {n} {unit}" + (f" ({runs} runs)" if runs > 1 else "")
        spec = GateSpec(kind="check", metric=stat["metric"], op=stat.get("op", ">="), threshold=float(stat["threshold"]),
                        check=name)
        return GateResult(name=name, gate=f"{label}: {stat['metric']}{stat.get('op', '>=')}{float(stat['threshold']):g}",
                          kind="check", spec=spec, outcome=v.outcome, value=v.ratio, low=v.low, high=v.high, interval=interval,
                          message=f"{stat['metric']} {v.message}", more_samples=v.more_samples, measured_in=measured_in)
    first = next((f for f in fb.findings if f.severity == "error"), None)
    detail = fb.error or ""
    if first is not None and first.message not in detail:
        detail = f"{detail}; first: {first.message}" if detail else first.message
    return GateResult(name=name, gate=label, kind="check", outcome="pass" if fb.ok else "fail", message=detail or "ok",
                      measured_in=measured_in)


def hypothesis_outcome(h: Hypothesis, candidate: Sequence[Feedback], baseline: Sequence[Feedback],
                       measured_in: str | None = None, confidence: float = 0.95,
                       noise: ProcessNoise | None = None) -> tuple[VerdictOutcome, GateResult]:
    """Supported / refuted / inconclusive for the hypothesis, with its gate."""
    if h.metric in COUNT_METRICS:
        return _count_outcome(h, candidate, baseline, measured_in)
    label = h.gate_text()
    ci, interval = ratio_ci(candidate, baseline, h.metric, h.scenario, confidence, noise)
    # The threshold as the gate text prints it (6 significant digits).
    spec = h.gate_spec()
    if ci is None:
        res = GateResult(name="hypothesis", gate=label, kind="hypothesis", spec=spec, outcome="inconclusive",
                         measured_in=measured_in,
                         message=f"{h.metric} was not measured on both sides"
                                 + (f" (scenario {h.scenario})" if h.scenario else "") + f": need >= {MIN_SAMPLES} runs each")
        return "inconclusive", res
    res = _result("hypothesis", label, spec, ci, interval, measured_in)
    outcome: VerdictOutcome = {"pass": "supported", "fail": "refuted"}.get(res.outcome, "inconclusive")  # type: ignore[assignment]
    return outcome, res


def _count_outcome(h: Hypothesis, candidate: Sequence[Feedback], baseline: Sequence[Feedback],
                   measured_in: str | None) -> tuple[VerdictOutcome, GateResult]:
    b, a = side_values(candidate, h.metric), side_values(baseline, h.metric)
    label = h.gate_text()
    if not b or not a:
        return "inconclusive", GateResult(name="hypothesis", gate=label, kind="hypothesis", spec=h.gate_spec(),
                                          outcome="inconclusive",
                                          measured_in=measured_in, message=f"{h.metric} missing on a side")
    cand, base = sum(b), sum(a)
    moved = base - cand if h.direction == "lower" else cand - base
    ok = moved >= max(h.min_effect, 1e-12)
    msg = f"{h.metric}: baseline {base:g} -> candidate {cand:g} (exact count, no interval needed)"
    res = GateResult(name="hypothesis", gate=label, kind="hypothesis", spec=h.gate_spec(), outcome="pass" if ok else "fail",
                     value=cand,
                     low=cand, high=cand, interval=EXACT_COUNT, message=msg, measured_in=measured_in)
    return ("supported" if ok else "refuted"), res
