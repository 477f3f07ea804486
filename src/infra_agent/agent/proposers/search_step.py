"""A search trial as the loop sees it: a ``Step`` with a hypothesis that says why these knobs,
a rationale that says how the values were chosen, and a change description that a resumed
run reads back (a local move names its stage)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infra_agent.agent.proposers.attribution import KnobScore
from infra_agent.agent.proposers.search_objective import Objective
from infra_agent.agent.proposers.search_ranges import KnobRange
from infra_agent.feedback import Location
from infra_agent.records import Change, Hypothesis, Step

LOCAL_MOVE = "search local move: "  # a local move's change description starts so
_LOCAL_STAGE = re.compile(rf"^{re.escape(LOCAL_MOVE)}.*\(stage: ([\w, ]+)\)$")


def local_stage(description: str) -> tuple[str, ...] | None:
    """The stage a local move was searched in, from its change description (None: not a local move)."""
    m = _LOCAL_STAGE.match(description)
    return tuple(m.group(1).split(", ")) if m else None


def show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass(frozen=True)
class Stage:
    """Where the search stands when it proposes: what the step's words are made of."""

    ranking: list[KnobScore]
    number: int  # 0-based
    count: int
    widenings: list[str]
    blind: bool


def why(active: tuple[str, ...], stage: Stage) -> str:
    """Why these knobs: the findings that ranked them (or that none did)."""
    if stage.blind:
        return f"blind search over all {len(active)} knobs"
    scores = {s.name: s for s in stage.ranking}
    parts: dict[str, None] = {}
    for k in active:
        s = scores.get(k)
        if s is not None and s.score > 0:
            for p in s.explain().split(", "):
                parts.setdefault(p, None)
    if not parts:
        return f"no finding points at a knob: searching all {len(active)} knobs, each moved alone first"
    text = "ranked by attribution: " + ", ".join(parts)
    if stage.number > 0:
        text += f"; widened to {len(active)} knobs"
    return text


def search_step(workspace: Any, objective: Objective, values: Mapping[str, Any], active: tuple[str, ...], stage: Stage,
                ranges: Mapping[str, KnobRange], trial_number: int, local: bool, min_effect: float) -> Step:
    order = [s.name for s in stage.ranking]
    shown = sorted(values, key=lambda k: order.index(k) if k in order else len(order))
    assignment = ", ".join(f"{k}={show(values[k])}" for k in shown)
    top = shown[0]
    knob = workspace.knobs[top]
    try:
        locality = Location(component=knob.components[0] if knob.components else None, knob=top)
    except ValueError:
        locality = Location(knob=top)
    obj = objective
    verb = "raises" if obj.direction == "higher" else "lowers"
    hypothesis = Hypothesis(statement=f"{assignment} {verb} {obj.metric} ({why(active, stage)})", metric=obj.metric,
                            direction=obj.direction, min_effect=min_effect, scenario=obj.scenario, locality=locality)
    where = f"stage {stage.number + 1}/{stage.count}: {', '.join(active)}"
    widened = f"; {stage.widenings[-1]}" if stage.widenings else ""
    sampled = ", ".join(f"{k} in {ranges[k].describe()}" for k in active if k in ranges and ranges[k].numeric)
    how = f"local move {trial_number} (one knob from the best, before TPE)" if local else f"TPE trial {trial_number}"
    rationale = (f"{how} ({where}{widened}); objective {obj.metric} ({obj.direction} is better, scored against the "
                 f"interleaved parent) from {obj.source or 'the ledger'}; "
                 + (f"measured by check {obj.check!r} on both sides; " if obj.check else "")
                 + (f"sampled in {sampled}; " if sampled else "")
                 + "knobs outside the space stay at the best configuration's values")
    # A local move's description names its stage: the change alone (one knob) does not say
    # which stage it was searched in, and a restored run continues in that stage.
    description = f"{LOCAL_MOVE}{assignment} (stage: {', '.join(active)})" if local else f"search: {assignment}"
    # An objective from a check's statistic is measured by that check on both sides (plan mode
    # pair), whatever components the moved knob names: it is the number the trial is scored on.
    return Step(hypothesis=hypothesis, change=Change(knobs=dict(values), diff=None, description=description),
                probe=obj.check, rationale=rationale)


__all__ = ["LOCAL_MOVE", "Stage", "local_stage", "search_step", "show", "why"]
