"""What the loop refuses to spend a run on: a step screened before anything starts.

A proposed step becomes an experiment either way (the ledger keeps every proposal),
but one that cannot or need not run is recorded as ``rejected`` with the reason, and
the loop goes on:

- knobs the workspace does not declare, or values outside their domains;
- a change that changes nothing (no diff, and every knob at the value the parent
  already has);
- the same change, on the same parent, as an experiment already tried.  Values are
  compared as the knobs parse them, so ``"16"``, ``16`` and ``16.0`` for an int knob
  are one change.
"""

from __future__ import annotations

from typing import Any

from infra_agent.agent.experiment import Change, Experiment, Step
from infra_agent.errors import InfraAgentError


def canonical_key(change: Change, knobs: dict[str, Any]) -> str:
    """``change.key()`` with each knob's value as it resolved (``knobs``: the experiment's config)."""
    return Change(knobs={k: knobs.get(k, v) for k, v in change.knobs.items()}, diff=change.diff).key()


def screen(workspace: Any, step: Step, best: Experiment, history: list[Experiment]) -> tuple[dict[str, Any], str | None]:
    """The candidate's knob values, and why the step must not run (None when it may)."""
    try:
        knobs = dict(workspace.resolve_knobs({**best.knobs, **step.change.knobs}))
    except InfraAgentError as exc:
        return {}, f"the change's knobs are invalid: {exc}"
    code = bool(step.change.diff and step.change.diff.strip())
    if not code and knobs == dict(best.knobs):
        what = f"sets {', '.join(sorted(step.change.knobs))} to the value(s) {best.id} already runs with" \
            if step.change.knobs else "has no knob values and no diff"
        return knobs, f"the change changes nothing: it {what}"
    key = canonical_key(step.change, knobs)
    for e in history:
        if e.role == "experiment" and e.parent == best.id and canonical_key(e.change, e.knobs) == key:
            outcome = e.verdict.outcome if e.verdict else e.status
            return knobs, f"the same change was already tried on {best.id} in experiment {e.id} ({outcome})"
    return knobs, None
