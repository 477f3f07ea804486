"""Gates the judge is given as text or criteria, as the :class:`~infra_agent.stats.decision.Gate` it decides.

The decision rule itself (pass / fail / inconclusive from an interval) is
:mod:`infra_agent.stats.decision`.
"""

from __future__ import annotations

import math
from typing import Any

from infra_agent.errors import BenchmarkError
from infra_agent.records import parse_gate_text
from infra_agent.stats.decision import Gate


def parse_gate(text: str) -> Gate:
    """A ratio gate typed on the command line (``compare --criterion``), read by the records' one gate parser."""
    spec = parse_gate_text(text, "relative")
    if spec is None or spec.scenario is not None or spec.kind != "relative" or not 0 <= spec.threshold < math.inf:
        raise BenchmarkError(f"cannot read criterion {text!r}; expected METRIC OP RATIO, e.g. 'output_throughput>=0.95'")
    return Gate(metric=spec.metric, op=spec.op, threshold=spec.threshold)


def gate_from_criterion(criterion: Any) -> Gate:
    """A relative workspace ``Criterion`` (``ratio`` set) as a gate."""
    if criterion.ratio is None:
        raise BenchmarkError(f"criterion {criterion.name!r} is absolute (value={criterion.value}); the judge compares ratios")
    return Gate(metric=criterion.metric, op=criterion.op, threshold=float(criterion.ratio))


__all__ = ["gate_from_criterion", "parse_gate"]
