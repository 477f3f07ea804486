"""A check's statistic (``Feedback.meta["gate"]``) decided on its interval.

A check whose verdict is a statistic (the timeline probe's ``kv_transfer`` on/off ratio)
reports its samples as data; the probe that measured them and the judge that pools runs
both decide it here, by the one rule (:mod:`infra_agent.stats.decision`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra_agent.stats.decision import Gate, GateDecision, decide
from infra_agent.stats.intervals import log_ratio_interval

GATE_META = "gate"  # Feedback.meta key of a check's statistic
GATE_FAILED = "gate_failed"  # Feedback.meta key: the run measured, and its statistic missed the line


def decide_statistic(stat: Mapping[str, Any], confidence: float = 0.95) -> GateDecision:
    """pass / fail / inconclusive for a check's statistic, from the interval of its samples."""
    samples = [float(s) for s in stat["samples"] if isinstance(s, (int, float)) and s > 0]
    gate = Gate(str(stat["metric"]), stat.get("op", ">="), float(stat["threshold"]))
    return decide(gate, log_ratio_interval(samples, confidence=confidence) if samples else None)


__all__ = ["GATE_FAILED", "GATE_META", "decide_statistic"]
