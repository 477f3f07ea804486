"""A configuration the server refused: a refuted experiment whose finding quotes the engine.

An engine that rejects its arguments exits at start-up (vLLM refuses
``max_num_batched_tokens`` below ``max_num_seqs``), before any benchmark ran.  That is an
answer, not a failure of the experiment: this configuration does not run.  So the
experiment ends ``done`` with a ``refuted`` verdict whose message quotes the engine's
error line, and a ``server_refused_config`` finding that names the knobs that differ from
the baseline, keeps the reason and the exit code, and points at the log (an artifact too).

A refusal belongs to the configuration, not to the parent's code: screening
(agent/screening.py) refuses the same knob values on any parent (:func:`refusal_of`).
Only a knob change counts there: an experiment with a diff may have been refused for its
code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra_agent.agent.executors.base import Refusal
from infra_agent.agent.planner import Plan
from infra_agent.feedback import Artifact, Feedback, Finding, Location
from infra_agent.records import Experiment, Verdict
from infra_agent.vocabulary import FindingKind


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def changed_knobs(knobs: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs of ``knobs`` whose value differs from the baseline's."""
    return {k: v for k, v in sorted(knobs.items()) if k not in baseline or baseline[k] != v}


def quote(reason: str | None, exit_code: object) -> str:
    """What the engine said, or, when its log names nothing, that it said nothing."""
    return reason or f"it exited with code {exit_code} and its log names no error line"


def record_refusal(exp: Experiment, refusal: Refusal, plan: Plan, baseline: Mapping[str, Any]) -> None:
    """``exp`` as a refuted configuration: its verdict, its finding, its log as an artifact."""
    changed = changed_knobs(exp.knobs, baseline)
    what = ", ".join(f"{k}={_show(v)} (baseline {_show(baseline.get(k, '-'))})" for k, v in changed.items()) \
        or "the baseline's knob values with this change's code"
    said = quote(refusal.reason, refusal.exit_code)
    finding = Finding(
        kind=FindingKind.SERVER_REFUSED_CONFIG, severity="error",
        message=f"{refusal.server} refused {what}: {said}",
        location=Location(knob=next(iter(changed))) if len(changed) == 1 else None,
        evidence={"reason": refusal.reason, "exit_code": refusal.exit_code, "knobs": changed,
                  "baseline": {k: baseline.get(k) for k in changed}, "log": refusal.log_path},
        next_question="Which values does the engine accept? Its error line states the limit it checks"
                      + (f" for {', '.join(changed)}." if changed else "."),
    )
    artifacts = [Artifact(kind="log", path=refusal.log_path, description="the log of the server that refused")] \
        if refusal.log_path else []
    message = f"the configuration was refused: {refusal.server} exited at start-up (exit code {refusal.exit_code}): {said}"
    exp.feedback = Feedback(probe=plan.probe.name, tier=plan.probe.tier, ok=False, error=message, findings=[finding],
                            artifacts=artifacts)
    exp.verdict = Verdict(outcome="refuted", message=message)
    exp.status, exp.error = "done", None


def refusal_of(exp: Experiment) -> str | None:
    """The quote of the server's refusal when ``exp`` is a knob change the server refused, else None."""
    if exp.role != "experiment" or exp.status != "done" or (exp.change.diff and exp.change.diff.strip()):
        return None
    found = next((f for f in (exp.feedback.findings if exp.feedback else [])
                  if f.kind == FindingKind.SERVER_REFUSED_CONFIG), None)
    if found is None:
        return None
    reason = found.evidence.get("reason")
    return quote(str(reason) if reason else None, found.evidence.get("exit_code"))


__all__ = ["changed_knobs", "quote", "record_refusal", "refusal_of"]
