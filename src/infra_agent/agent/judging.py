"""Text the loop writes about an experiment: a failure as a finding, an accepted one as a commit message.

The accept rule itself is :mod:`infra_agent.judge.accept`.
"""

from __future__ import annotations

from typing import Any

from infra_agent.records import Experiment


def failure_finding(kind: str, message: str) -> Any:
    from infra_agent.feedback import Finding

    return Finding(kind=kind, severity="error", message=message.splitlines()[0][:300] if message else kind,
                   evidence={"detail": message[-2000:]} if message else {})


def commit_message(exp: Experiment) -> str:
    v = exp.verdict
    h = exp.hypothesis
    lines = [f"infra-agent {exp.id}: {h.statement}"[:200], "",
             f"Hypothesis: {h.metric} {'rises' if h.direction == 'higher' else 'falls'} by >= {h.min_effect:g}"
             + (f" in scenario {h.scenario}" if h.scenario else ""),
             f"Verdict: {v.outcome if v else exp.status}" + _effect(exp),
             f"Run: {exp.run_id}, parent {exp.parent}"]
    if v:
        lines += [f"Gate {g.name}: {g.outcome}" for g in v.gates if g.kind != "hypothesis"]
    return "\n".join(lines)


def _effect(exp: Experiment) -> str:
    from infra_agent.judge.effect_text import count_move, effect_text

    v = exp.verdict
    if count_move(exp) is not None:  # a count's move, not a ratio-style "effect 0 [0, 0]"
        return f", {effect_text(exp)}"
    if v and v.effect is not None and v.low is not None and v.high is not None:
        return f", effect {v.effect:.4g} [{v.low:.4g}, {v.high:.4g}] ({v.interval})"
    return ""


__all__ = ["commit_message", "failure_finding"]
