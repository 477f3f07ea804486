"""What the loop refuses to spend a run on: a step screened before anything starts.

A proposed step becomes an experiment either way (the ledger keeps every proposal),
but one that cannot or need not run is recorded as ``rejected`` with the reason, and
the loop goes on:

- knobs the workspace does not declare, or values outside their domains;
- a change that changes nothing (no diff, and every knob at the value the parent
  already has);
- a configuration that breaks one of the workspace's ``constraints`` (vLLM refuses
  ``max_num_batched_tokens`` below ``max_num_seqs``: a launch that fails after minutes);
- a change that sets a ``resource`` knob above what the machine has: thread knobs x
  their processes over the cores the target may use (``torch_threads=448 x 2 processes
  > 2 cores``), memory knobs over the machine's memory;
- a no-op: every changed knob at an alias of the parent's value (``kv_cache_dtype:
  bfloat16`` where ``auto`` is bfloat16), or a launch that renders exactly as the
  parent's (the command, env and cwd with ``{port}`` fixed, and every check's config);
- a configuration (all its knob values) the server refused before, on any parent: the engine
  rejects its arguments whatever code the parent has (agent/refused.py); the message quotes
  its error line;
- the same change, on the same parent, as an experiment already tried and decided
  (refuted, accepted, or failed); one left open (inconclusive, promising) is topped up
  instead (:func:`open_match`, agent/rounds.py).  Values are
  compared as the knobs parse them, so ``"16"``, ``16`` and ``16.0`` for an int knob
  are one change.

Each message names the knob, the value, the limit and where the limit comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra_agent.agent.refused import refusal_of
from infra_agent.errors import InfraAgentError
from infra_agent.records import Change, Experiment, Step
from infra_agent.target.launch import plan_launch
from infra_agent.workspace.machine import oversubscriptions
from infra_agent.workspace.models import ServerTargetSpec, Workspace

# ``{port}`` renders the same on both sides of a launch comparison: the port is chosen at
# start, so it never distinguishes two configurations.
_PORT = 0


def canonical_key(change: Change, knobs: dict[str, Any]) -> str:
    """``change.key()`` with each knob's value as it resolved (``knobs``: the experiment's config)."""
    return Change(knobs={k: knobs.get(k, v) for k, v in change.knobs.items()}, diff=change.diff).key()


def rendered_launch(workspace: Workspace, knobs: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What a configuration launches, as data: the server target's argv, env and cwd rendered
    with ``knobs`` (``{port}`` fixed), and every check's config rendered with them.  None when
    it cannot be rendered (not a server target, a knob without a value)."""
    target = getattr(workspace, "target", None)
    if not isinstance(target, ServerTargetSpec):
        return None
    try:
        plan = plan_launch(target, knobs, _PORT, root=workspace.root, host="127.0.0.1")
        checks = [repr(c.render(knobs)) for c in workspace.checks]
    except (InfraAgentError, KeyError):
        return None
    return (tuple(plan.argv), tuple(sorted(plan.env.items())), str(plan.cwd), tuple(checks))


def same_launch(workspace: Workspace, a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Both configurations launch the same thing (and render every check alike)."""
    ra = rendered_launch(workspace, a)
    return ra is not None and ra == rendered_launch(workspace, b)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def space_problem(workspace: Workspace, knobs: Mapping[str, Any], changed: set[str]) -> str | None:
    """Why the configuration ``knobs`` (``changed``: the knobs the step sets) must not launch:
    a broken constraint or an oversubscribed machine; None when neither."""
    broken = workspace.broken_constraints(knobs)
    if broken:
        i, c = broken[0]
        return f"it breaks the constraint {c.text!r} (constraints.{i} in infra-agent.yaml): {c.broken(knobs)}"
    over = oversubscriptions(workspace.knobs, knobs, workspace.machine_limits(), only=changed)
    return f"it {over[0].message()}" if over else None


def alias_noop(workspace: Workspace, change: Mapping[str, Any], knobs: Mapping[str, Any], parent: Mapping[str, Any]) -> str | None:
    """Every knob the change sets launches as the parent's value (``aliases``): what it sets, else None."""
    parts = []
    for name in change:
        knob = workspace.knobs.get(name)
        new, old = knobs.get(name), parent.get(name)
        if knob is None or new is None or old is None:
            return None
        if new == old and type(new) is type(old):
            continue
        if knob.canonical(new) != knob.canonical(old):
            return None
        parts.append(f"{name}={_show(new)} is an alias of {_show(old)}, the parent's value "
                     f"(knobs.{name}.aliases in infra-agent.yaml)")
    return "; ".join(parts) or None


def screen(workspace: Workspace, step: Step, best: Experiment, history: list[Experiment]) -> tuple[dict[str, Any], str | None]:
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
    problem = space_problem(workspace, knobs, set(step.change.knobs))
    if problem is not None:
        return knobs, f"the change cannot run: {problem}"
    if not code:
        noop = alias_noop(workspace, step.change.knobs, knobs, best.knobs)
        if noop is not None:
            return knobs, f"the change changes nothing: {noop}"
        if best.knobs and same_launch(workspace, knobs, best.knobs):
            changed = ", ".join(f"{k}={_show(knobs[k])}" for k in sorted(step.change.knobs) if k in knobs)
            return knobs, (f"the change changes nothing: with {changed} the launch renders exactly as {best.id}'s "
                           "(command, env, cwd and every check's config): no placeholder uses what changed")
    refused = None if code else refused_before(workspace, history, knobs)
    if refused is not None:
        return knobs, (f"the same configuration was already tried in experiment {refused[0].id} and the server refused "
                       f"it: {refused[1]}")
    key = canonical_key(step.change, knobs)
    for e in history:
        if e.role == "experiment" and e.parent == best.id and canonical_key(e.change, e.knobs) == key:
            outcome = e.verdict.outcome if e.verdict else e.status
            return knobs, f"the same change was already tried on {best.id} in experiment {e.id} ({outcome})"
    return knobs, None


def refused_before(workspace: Workspace, history: list[Experiment], knobs: Mapping[str, Any]) -> tuple[Experiment, str] | None:
    """An experiment whose server refused these knob values (or values that launch the same), and its
    quote; on any parent, since a refusal depends on the configuration, not on the parent's code."""
    for e in history:
        reason = refusal_of(e)
        if reason is not None and (e.knobs == dict(knobs) or same_launch(workspace, e.knobs, knobs)):
            return e, reason
    return None


def open_match(workspace: Workspace, history: list[Experiment], best: Experiment, step: Step) -> Experiment | None:
    """An open experiment (inconclusive, promising) of the same change on the same parent: the
    step tops it up instead of being refused as already tried (``Experiment.open``)."""
    try:
        knobs = dict(workspace.resolve_knobs({**best.knobs, **step.change.knobs}))
    except InfraAgentError:
        return None
    key = canonical_key(step.change, knobs)
    return next((e for e in reversed(history) if e.open and e.parent == best.id
                 and canonical_key(e.change, e.knobs) == key), None)
