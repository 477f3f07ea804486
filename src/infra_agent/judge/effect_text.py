"""An experiment's effect in one phrase, the way each kind of hypothesis metric is decided.

A ratio metric's effect is the candidate/parent ratio with its interval
(``effect 1.15 [1.09, 1.20]``).  A count (``failed_checks``, ...) is decided exactly, so a
ratio-style ``effect 0 [0, 0]`` would read as "no change" for a fix that took three
failing checks to none; it prints the move instead (``failed_checks 3 → 0, exact count``).
The progress line, the agent's tools and the MCP text use this; the report puts the move
(:func:`count_move`) in its own columns, and a gate on a count shows its value alone
(:func:`gate_estimate`).
"""

from __future__ import annotations

from infra_agent.judge.gates import side_values
from infra_agent.records import COUNT_METRICS, EXACT_COUNT, Experiment, GateResult


def _num(x: float) -> str:
    return f"{x:.4g}"


def count_move(exp: Experiment) -> str | None:
    """``3 → 0`` for a count hypothesis with an effect (``= 0`` when the parent's count is not
    known), None for any other experiment."""
    v = exp.verdict
    metric = exp.hypothesis.metric
    if v is None or v.effect is None or metric not in COUNT_METRICS:
        return None
    other = exp.baseline_feedback
    # A pooled side keeps only its first run's count, so the parent's count is shown
    # only when its side is one run.
    parent = side_values([other], metric) if other is not None and other.meta.get("runs", 1) == 1 else []
    return f"{_num(sum(parent))} → {_num(v.effect)}" if parent else f"= {_num(v.effect)}"


def effect_text(exp: Experiment) -> str:
    """``effect 1.15 [1.09, 1.2]``, ``failed_checks 3 → 0 (exact count)``, or '' with no effect."""
    v = exp.verdict
    if v is None or v.effect is None:
        return ""
    move = count_move(exp)
    if move is not None:
        return f"{exp.hypothesis.metric} {move} ({EXACT_COUNT})"
    ci = f" [{_num(v.low)}, {_num(v.high)}]" if v.low is not None and v.high is not None else ""
    return f"effect {_num(v.effect)}{ci}"


def gate_estimate(g: GateResult) -> str:
    """A gate's value as text: ``1.15 [1.09, 1.2]``, ``0 (exact count)``, or '' when it has none.

    A count's gate carries its value as a zero-width interval ([0, 0]), which reads as a
    measured ratio; the count is exact, and says so instead."""
    if g.value is None:
        return ""
    if g.interval == EXACT_COUNT:
        return f"{_num(g.value)} ({EXACT_COUNT})"
    ci = f" [{_num(g.low)}, {_num(g.high)}]" if g.low is not None and g.high is not None else ""
    return f"{_num(g.value)}{ci}"


__all__ = ["EXACT_COUNT", "count_move", "effect_text", "gate_estimate"]
