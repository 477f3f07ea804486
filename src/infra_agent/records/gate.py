"""Gates as data: :class:`GateSpec` (what a gate asks) and :class:`GateResult` (how it ended).

A gate is parsed once: the workspace loader turns each criterion into a ``GateSpec``
(``Criterion.spec``), the judge builds the specs of hypotheses and checks, and every
``GateResult`` carries its spec (``GateResult.spec``).  Readers of a result (the report,
the search proposer, attribution) read ``spec``; ``gate`` is the label a person reads.

:func:`parse_gate_text` is the one parser of gate text.  It serves two kinds of input
that arrive as text: a gate typed on the command line (``compare --criterion``), and a
record written before gates carried a spec (the ledger holds JSON of GateResults), which
gets its spec once, when it is loaded.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

Op = Literal[">=", "<=", ">", "<"]
GateKind = Literal["absolute", "relative", "check", "hypothesis"]
GateOutcome = Literal["pass", "fail", "inconclusive", "error", "skipped"]
# Exact counts a check reports in Feedback.meta: compared exactly, as differences.
COUNT_METRICS: frozenset[str] = frozenset({"failed_checks", "refused_entries", "timing_failures", "checked"})
# The interval label of a count's gate: compared exactly, so its value has no interval
# (the [0, 0] its low and high would make reads as a measured ratio).
EXACT_COUNT = "exact count"

_NUM = r"[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|inf)"
# The labels the judge writes: "output_throughput>=300 @chat", "p99_ttft_ms<=1.1 @chat x baseline".
_THRESHOLD = re.compile(rf"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<)\s*({_NUM})\s*(?:@\s*(\S+))?\s*(x\s+baseline)?\s*$")
# A hypothesis on an exact count: "failed_checks <= baseline - 1".
_DIFFERENCE = re.compile(rf"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|>|<)\s*baseline\s*[-+]\s*({_NUM})\s*$")
# A check that gates on a statistic: "check kv (kv_transfer/e2e): kv_ratio>=0.95".
_CHECK = re.compile(r"^\s*check\s+(\S+)(?:\s+\([^)]*\))?(?::\s*(.*))?$")


class GateSpec(BaseModel):
    """What one gate asks: ``metric op threshold``.

    ``threshold`` is a value of the metric for an ``absolute`` gate, a candidate/baseline
    ratio for a ``relative`` or ``hypothesis`` gate (for a hypothesis on a count metric,
    :data:`COUNT_METRICS`, the absolute change), and the statistic's threshold for a
    ``check`` that gates on one.  ``check`` names the workspace check whose Feedback
    decides it (a criterion on the quality probe's ``kl_div``, or a check's own gate)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: GateKind
    metric: str
    op: Op
    threshold: float
    scenario: str | None = None
    check: str | None = None

    @property
    def relative(self) -> bool:
        return self.kind in ("relative", "hypothesis")

    @property
    def higher(self) -> bool:
        """Whether the gate bounds the metric from below (higher is better)."""
        return self.op in (">=", ">")


def parse_gate_text(text: str, kind: GateKind | None = None) -> GateSpec | None:
    """The spec of a gate label, or None when ``text`` is not one (a check that gates on
    ``ok`` alone has no threshold).  ``kind`` is the result's kind when known; without it a
    ``... x baseline`` label is relative and any other threshold absolute."""
    check = _CHECK.match(text)
    if check is not None:
        stat = parse_gate_text(check.group(2), "absolute") if check.group(2) else None
        if stat is None:
            return None
        return stat.model_copy(update={"kind": "check", "check": check.group(1), "scenario": None})
    diff = _DIFFERENCE.match(text)
    if diff is not None:
        return GateSpec(kind="hypothesis", metric=diff.group(1), op=diff.group(2), threshold=float(diff.group(3)))  # type: ignore[arg-type]
    m = _THRESHOLD.match(text)
    if m is None:
        return None
    if kind is None or kind == "check":
        kind = "relative" if m.group(5) else "absolute"
    return GateSpec(kind=kind, metric=m.group(1), op=m.group(2), threshold=float(m.group(3)),  # type: ignore[arg-type]
                    scenario=m.group(4))


class GateResult(BaseModel):
    """One gate (a criterion or a check) evaluated on one configuration."""

    model_config = ConfigDict(extra="forbid")

    name: str
    gate: str  # the label a person reads: "output_throughput>=300 @chat" or "check lm-head-tp"
    kind: GateKind
    outcome: GateOutcome
    # What the gate asks, as data; None for a check that passes on its Feedback being ok.
    spec: GateSpec | None = None
    value: float | None = None  # the estimate (a ratio for relative gates)
    low: float | None = None
    high: float | None = None
    interval: str = ""  # what the interval is: "95% paired bootstrap CI of the mean ratio over 3 runs"
    message: str = ""
    more_samples: int | None = None
    measured_in: str | None = None  # the experiment id whose runs gave this outcome

    @model_validator(mode="before")
    @classmethod
    def _spec_of_older_records(cls, data: Any) -> Any:
        """A result written before gates carried a spec gets one from its label, once, here."""
        if isinstance(data, dict) and data.get("spec") is None and isinstance(data.get("gate"), str):
            spec = parse_gate_text(data["gate"], data.get("kind"))
            if spec is not None:
                data = {**data, "spec": spec}
        return data

    @field_validator("value", "low", "high")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        return v if v is None or math.isfinite(v) else None


__all__ = ["COUNT_METRICS", "GateKind", "GateOutcome", "GateResult", "GateSpec", "Op", "parse_gate_text"]
