"""Experiment tools: ``set_knobs``, ``run_experiment``, ``read_ledger`` and ``finish``.

``set_knobs`` and ``propose_diff`` build the pending change; ``run_experiment`` pairs
it with one hypothesis into a ``Step`` and hands it to ``ctx.submit_step`` (the
caller decides when it runs; its verdict comes back as this call's result).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from infra_agent.errors import ConfigError, InfraAgentError
from infra_agent.records import Change, Experiment, Hypothesis, Step
from infra_agent.tools.registry import Tool, ToolArgs, ToolContext, ToolResult
from infra_agent.vocabulary import FindingKind

KnobInput = bool | int | float | str | None


# ---------------------------------------------------------------- set_knobs


class SetKnobsArgs(ToolArgs):
    knobs: dict[str, KnobInput] = Field(description="knob name -> value, checked against the knob's domain; merged into "
                                                    "the pending change; null drops a knob from it, {} clears all")


def set_knobs(ctx: ToolContext, args: SetKnobsArgs) -> ToolResult:
    ws = ctx.workspace
    if ws is None:
        return ToolResult.fail("set_knobs: no workspace is loaded, so there are no knobs to set")
    if not args.knobs:
        had = dict(ctx.pending.knobs)
        ctx.pending = ctx.pending.model_copy(update={"knobs": {}})
        return ToolResult(text="pending knobs cleared" if had else "no pending knobs to clear", data={"knobs": {}})
    base = dict(ctx.state.best_knobs()) if ctx.state is not None else {}
    base = {k: v for k, v in base.items() if k in ws.knobs}
    accepted: dict[str, Any] = {}
    dropped: list[str] = []
    errors: list[str] = []
    for name, value in args.knobs.items():
        if value is None:
            dropped.append(name)
            continue
        knob = ws.knobs.get(name)
        if knob is None:
            errors.append(f"knob {name!r}: not declared in the workspace (the knobs are: {', '.join(sorted(ws.knobs)) or 'none'})")
            continue
        try:
            accepted[name] = ws.resolve_knobs({**base, name: value})[name]
        except ConfigError as exc:
            if exc.field in (f"knobs.{name}", "knobs"):
                errors.append(f"knob {name!r}: expected {exc.expected} (its domain), got {value!r}")
            else:  # another knob's problem (a launch placeholder without a value): check this one alone
                try:
                    accepted[name] = knob.parse(value) if isinstance(value, str) else knob.check(value)
                except ValueError:
                    errors.append(f"knob {name!r}: expected {knob.domain()} (its domain), got {value!r}")
    if errors:
        return ToolResult.fail("set_knobs: nothing changed; " + "; ".join(errors), errors=errors)
    knobs = {k: v for k, v in {**ctx.pending.knobs, **accepted}.items() if k not in dropped}
    ctx.pending = ctx.pending.model_copy(update={"knobs": knobs})
    same = sorted(k for k, v in accepted.items() if k in base and base[k] == v)
    text = "pending knobs: " + (", ".join(f"{k}={v!r}" for k, v in knobs.items()) or "none")
    if same:
        text += f" (equal to the current best already: {', '.join(same)})"
    return ToolResult(text=text + "; pending until run_experiment", data={"knobs": knobs, "unchanged": same})


# ---------------------------------------------------------------- run_experiment


class RunExperimentArgs(Hypothesis):
    """The hypothesis this experiment tests (its fields, flat), plus why."""

    rationale: str = Field("", description="why you expect it: the evidence (findings, measurements, code) behind it")


def run_experiment(ctx: ToolContext, args: RunExperimentArgs) -> ToolResult:
    if ctx.submit_step is None:
        return ToolResult.fail("run_experiment: experiments cannot be run from here (no loop to hand them to)")
    hypothesis = Hypothesis.model_validate(args.model_dump(exclude={"rationale"}))
    ws = ctx.workspace
    if hypothesis.scenario is not None and ws is not None and hypothesis.scenario not in ws.scenarios:
        return ToolResult.fail(f"run_experiment: field 'scenario': expected one of the workspace scenarios "
                               f"{sorted(ws.scenarios)}, got {hypothesis.scenario!r}")
    change = ctx.pending.model_copy(update={"description": ctx.pending.description or hypothesis.statement})
    if change.empty:
        return ToolResult.fail("run_experiment: nothing to test: the pending change is empty; "
                               "call set_knobs and/or propose_diff first")
    top_up = None
    if ctx.state is not None:
        top_up, tried = _tried(ctx.state, change)
        if tried is not None:
            return ToolResult.fail(f"run_experiment: this change was already tried in experiment {tried.id} "
                                   f"({_outcome(tried)}); change something else")
    step = Step(hypothesis=hypothesis, change=change, probe=None, rationale=args.rationale)
    ctx.submit_step(step)
    ctx.pending = Change(diff=None)
    how = f"as one more batch of the open experiment {top_up.id}" if top_up is not None else "experiment submitted"
    return ToolResult(text=f"{how}: {hypothesis.statement} [{hypothesis.gate_text()}]; its verdict is this call's result",
                      data={"step": step.model_dump(mode="json"), "top_up_of": top_up.id if top_up else None})


def _tried(state: Any, change: Change) -> tuple[Experiment | None, Experiment | None]:
    """``(open, decided)``: the open experiment (inconclusive, promising) of this change on the current
    best, which the loop tops up with one more batch, since inconclusive is not refuted; else the
    experiment that already decided it: accepted on any parent (its change is in the best already), or
    tried on the current best.  The same change refuted on an earlier parent may run again on this one:
    the code and knobs it is measured against have changed since."""
    best = state.best.id
    same = [e for e in state.history if e.parent is not None and e.change.key() == change.key()]
    open_one = next((e for e in reversed(same) if e.open and e.parent == best), None)
    if open_one is not None:
        return open_one, None
    return None, next((e for e in same if e.accepted or e.parent == best), None)


# ---------------------------------------------------------------- read_ledger


class ReadLedgerArgs(ToolArgs):
    last_n: int = Field(10, ge=1, le=200, description="how many of the latest experiments to list")


def experiment_summary(e: Experiment) -> dict[str, Any]:
    change: dict[str, Any] = {"knobs": dict(e.change.knobs)}
    if e.change.diff:
        from infra_agent.tools.code import diff_paths

        try:
            change["diff_paths"] = diff_paths(e.change.diff)
        except InfraAgentError:
            change["diff_paths"] = ["(unparsed)"]
    v = e.verdict
    return {
        "id": e.id,
        "seq": e.seq,
        "parent": e.parent,
        "status": e.status,
        "hypothesis": e.hypothesis.statement,
        "gate": e.hypothesis.gate_text(),
        "change": change,
        "verdict": None if v is None else {"outcome": v.outcome, "effect": v.effect, "low": v.low, "high": v.high,
                                           "accepted": v.accepted, "message": v.message,
                                           "failed_gates": [g.name for g in v.failed_gates]},
        "error": e.error,
        "cost": {"wall_s": round(e.cost.wall_s, 2), "tier": e.cost.tier.value if e.cost.tier else None,
                 "e2e_runs": e.cost.e2e_runs, "launches": e.cost.launches, "llm_tokens": e.cost.llm_tokens},
    }


def _outcome(e: Experiment) -> str:
    if e.verdict is None:
        return e.status + (f": {e.error}" if e.error else "")
    from infra_agent.judge.effect_text import effect_text

    v = e.verdict
    refused = next((f for f in e.feedback.findings if f.kind == FindingKind.SERVER_REFUSED_CONFIG), None) \
        if e.feedback is not None else None
    if refused is not None:
        return f"{v.outcome}: {refused.message}"  # nothing was measured: what the server said is the answer
    eff = effect_text(e)
    return f"{v.outcome}{' ' + eff if eff else ''}{' accepted' if v.accepted else ''}"


def read_ledger(ctx: ToolContext, args: ReadLedgerArgs) -> ToolResult:
    if ctx.state is None:
        return ToolResult(text="no experiments yet (no run state)", data={"experiments": []})
    history = ctx.state.history[-args.last_n:]
    rows = [experiment_summary(e) for e in history]
    lines = [f"{len(ctx.state.history)} experiments in run {ctx.state.run.id}; current best: {ctx.state.best.id}"
             + (f"; showing the last {len(history)}" if len(history) < len(ctx.state.history) else "")]
    for e, row in zip(history, rows):
        parts = []
        if e.change.knobs:
            parts.append("knobs " + ",".join(f"{k}={v}" for k, v in e.change.knobs.items()))
        if e.change.diff:
            parts.append("diff " + ",".join(row["change"].get("diff_paths", [])))
        change = " ".join(parts) or ("(baseline)" if e.parent is None else "(no change)")
        lines.append(f"- {e.id} parent={e.parent or '-'} {change} | {e.hypothesis.statement} [{row['gate']}] "
                     f"-> {_outcome(e)} | {row['cost']['wall_s']} s, {e.cost.runs_text()}, {e.cost.llm_tokens} LLM tokens")
    return ToolResult(text="\n".join(lines), data={"experiments": rows, "best": ctx.state.best.id})


# ---------------------------------------------------------------- finish


class FinishArgs(ToolArgs):
    reason: str = Field(min_length=1, description="why you stop: what was found, or why nothing more is worth trying")


def finish(ctx: ToolContext, args: FinishArgs) -> ToolResult:
    ctx.finished = args.reason
    return ToolResult(text=f"finished: {args.reason}", data={"reason": args.reason})


TOOLS = [
    Tool("set_knobs", "Set knob values for the next experiment (checked against each knob's domain).",
         SetKnobsArgs, set_knobs),
    Tool("run_experiment", "Run one experiment: the pending knobs and/or diff, tested against the current best under "
                           "ONE hypothesis (the metric it predicts, the direction, the minimum effect). The verdict, "
                           "and both sides' metrics and findings (the parent's and the change's, labelled), come back "
                           "as this call's result. The same change as an open experiment (inconclusive, promising) "
                           "tops that one up with more pairs.", RunExperimentArgs, run_experiment),
    Tool("read_ledger", "List this run's experiments: hypothesis, change, verdict, cost.", ReadLedgerArgs, read_ledger),
    Tool("finish", "Stop proposing experiments, with the reason.", FinishArgs, finish),
]
