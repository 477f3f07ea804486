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
- one run per side: the judge refuses to decide (``inconclusive``, asking for
  repeated interleaved runs, at least ``MIN_SAMPLES`` per side).  Two runs of identical
  configurations differ by more than their requests' spread suggests (the server
  process, the machine's load in that minute), and one run per side cannot see that
  spread: bootstrapping the requests of a single run made 19 of 24 latency intervals
  of identical A/A configurations exclude 1.0.  ``per_request=True`` opts in to that
  per-request bootstrap anyway (latency metrics only; labelled "per-request bootstrap:
  ignores between-run variance").

A side whose every run failed (``ok: false``, or no completed request) is reported as
failed: a gate fails when the candidate failed, and is inconclusive when the baseline
did.  ``workload_mismatch`` says whether two sets of runs ran the same workload.

The code lives in one module per concept, re-exported here (import from here):
:mod:`infra_agent.stats.decision` (gates, ``decide``), :mod:`infra_agent.judge.decision` (reading gates), :mod:`infra_agent.judge.compare`
(runs to ``MetricComparison`` and a verdict per gate) and
:mod:`infra_agent.judge.workload` (``workload_mismatch``).
"""

from __future__ import annotations

from infra_agent.judge.compare import (
    MIN_BOOT,
    PER_REQUEST_LABEL,
    Comparison,
    MetricComparison,
    check_options,
    compare_metric,
    compare_runs,
)
from infra_agent.judge.decision import gate_from_criterion, parse_gate
from infra_agent.judge.workload import WORKLOAD_KEYS, workload_mismatch
from infra_agent.serving.metrics import LATENCY_METRICS
from infra_agent.stats.decision import (
    MIN_SAMPLES,
    Gate,
    GateDecision,
    decide,
    more_samples_needed,
)

__all__ = ["LATENCY_METRICS", "MIN_BOOT", "MIN_SAMPLES", "PER_REQUEST_LABEL", "WORKLOAD_KEYS", "Comparison", "Gate",
           "GateDecision", "MetricComparison", "check_options", "compare_metric", "compare_runs", "decide",
           "gate_from_criterion", "more_samples_needed", "parse_gate", "workload_mismatch"]
