"""An experiment's effect in one phrase, the way each kind of hypothesis metric is decided.

A ratio metric's effect is the candidate/parent ratio with its interval
(``effect 1.15 [1.09, 1.20]``).  A count (``failed_checks``, ...) is decided exactly, so a
ratio-style ``effect 0 [0, 0]`` would read as "no change" for a fix that took three
failing checks to none; it prints the move instead (``failed_checks 3 → 0, exact count``).
The progress line and the agent's tools use this; the report has its own columns.
"""

from __future__ import annotations

from infra_agent.judge.gates import side_values
from infra_agent.records import COUNT_METRICS, Experiment


def _num(x: float) -> str:
    return f"{x:.4g}"


def effect_text(exp: Experiment) -> str:
    """``effect 1.15 [1.09, 1.2]``, ``failed_checks 3 → 0 (exact count)``, or '' with no effect."""
    v = exp.verdict
    if v is None or v.effect is None:
        return ""
    metric = exp.hypothesis.metric
    if metric in COUNT_METRICS:
        other = exp.baseline_feedback
        # A pooled side keeps only its first run's count, so the parent's count is shown
        # only when its side is one run.
        parent = side_values([other], metric) if other is not None and other.meta.get("runs", 1) == 1 else []
        moved = f"{_num(sum(parent))} → {_num(v.effect)}" if parent else f"= {_num(v.effect)}"
        return f"{metric} {moved} (exact count)"
    ci = f" [{_num(v.low)}, {_num(v.high)}]" if v.low is not None and v.high is not None else ""
    return f"effect {_num(v.effect)}{ci}"


__all__ = ["effect_text"]
