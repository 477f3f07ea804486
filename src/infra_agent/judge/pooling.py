"""Several runs of one probe on one configuration as one Feedback, and the statistic a check gates on.

A probe that runs more than once for an experiment (a second round when the judge could
not decide, a check re-run in the confirmation) gives the judge one Feedback per run.
The judge decides a gate **once** per experiment, on the pooled evidence: samples pooled
per measurement, the check's own statistic pooled across runs, findings de-duplicated.

**A check's statistic** (``meta["gate"]``): a check whose verdict is a statistic (the
timeline probe's ``kv_transfer`` on/off ratio) reports it as data, not as a bare
``ok``::

    {"metric": "kv_transfer_prefill_ratio", "op": ">=", "threshold": 0.95,
     "samples": [0.93, 0.97, 0.95], "unit": "interleaved pairs"}

``samples`` are per-pair ratios (log-normal noise).  Its gate is decided like every other
ratio: ``pass`` when the 95% interval of the geometric mean clears the threshold,
``fail`` when it lies wholly beyond it, ``inconclusive`` otherwise, with the samples it
would need (:func:`decide_statistic`).  A run reports its own decision (``ok=False`` and
``meta["gate_failed"]`` only when its interval lies beyond the line); pooling decides
again on every run's samples together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infra_agent.feedback import Feedback, Measurement
from infra_agent.stats.statistic import GATE_FAILED, GATE_META, decide_statistic


def statistic_of(fb: Feedback) -> dict[str, Any] | None:
    """The statistic ``fb`` gates on (``meta["gate"]``), when it reports one with samples."""
    stat = fb.meta.get(GATE_META)
    if isinstance(stat, Mapping) and isinstance(stat.get("samples"), list) and stat.get("threshold") is not None:
        return dict(stat)
    return None


def hard_failure(fb: Feedback) -> bool:
    """A run that failed to measure (an error, a dead server), not one whose statistic missed its line."""
    return not fb.ok and not fb.meta.get(GATE_FAILED)


def pool_runs(feedbacks: Sequence[Feedback]) -> Feedback | None:
    """Runs of one probe as one Feedback: samples pooled per (name, tags), findings de-duplicated,
    and, when every run measured, the check's statistic pooled and decided again (``ok``,
    ``error`` and ``gate_failed`` then follow that decision)."""
    if not feedbacks:
        return None
    first = feedbacks[0]
    merged: dict[tuple[str, tuple[tuple[str, str], ...]], Measurement] = {}
    for fb in feedbacks:
        for m in fb.measurements:
            key = (m.name, tuple(sorted(m.tags.items())))
            if key in merged:
                old = merged[key]
                merged[key] = Measurement.from_samples(m.name, m.unit, old.samples + m.samples, old.better, **old.tags)
            else:
                merged[key] = m
    seen: set[tuple[str, str]] = set()
    findings = []
    for fb in reversed(feedbacks):  # the latest run's wording of a recurring finding
        for f in fb.findings:
            fkey = (f.kind, str(f.location))
            if fkey not in seen:
                seen.add(fkey)
                findings.append(f)
    # A Feedback pooled earlier counts the runs it holds.
    meta: dict[str, Any] = {**first.meta, "runs": sum(_runs(fb.meta) for fb in feedbacks)}
    # Each serving window's prompt set (probes/serving.py): every run's, so the ledger shows
    # that no window of the experiment repeated another's prompts.
    prompts = [p for fb in feedbacks for p in (fb.meta.get("prompts") or []) if isinstance(fb.meta.get("prompts"), list)]
    if prompts:
        meta["prompts"] = prompts
    failed_gate = next((fb.meta[GATE_FAILED] for fb in feedbacks if not fb.ok and fb.meta.get(GATE_FAILED)), None)
    meta.pop(GATE_FAILED, None)
    if failed_gate is not None:
        meta[GATE_FAILED] = failed_gate
    out = Feedback(probe=first.probe, tier=first.tier, scope=first.scope, ok=all(fb.ok for fb in feedbacks),
                   error=next((fb.error for fb in feedbacks if fb.error), None), measurements=list(merged.values()),
                   findings=findings, artifacts=[a for fb in feedbacks for a in fb.artifacts], meta=meta)
    stats = [s for s in (statistic_of(fb) for fb in feedbacks) if s is not None]
    hard = [fb for fb in feedbacks if hard_failure(fb)]
    if stats and len(feedbacks) > 1 and not hard:
        # Every run measured: the statistic decides again on all their samples together.
        pooled = {**stats[0], "samples": [x for s in stats for x in s["samples"]], "runs": sum(_runs(s) for s in stats)}
        verdict = decide_statistic(pooled)
        pooled.update(outcome=verdict.outcome, value=verdict.ratio, low=verdict.low, high=verdict.high,
                      message=verdict.message)
        # (out.meta, not meta: pydantic copied the dict when it built ``out``)
        out.meta[GATE_META] = pooled
        out.meta.pop(GATE_FAILED, None)
        out.ok, out.error = True, None
        if verdict.outcome == "fail":
            out.ok, out.error = False, f"{pooled['metric']}: {verdict.message} (pooled over {pooled['runs']} runs)"
            out.meta[GATE_FAILED] = pooled["metric"]
    return out


def _runs(meta: Mapping[str, Any]) -> int:
    n = meta.get("runs")
    return n if isinstance(n, int) and n > 0 else 1


def side_feedback(side: Mapping[str, Sequence[Feedback]]) -> Feedback | None:
    """All runs of one side (every scenario, or the one check) as one Feedback."""
    return pool_runs([fb for runs in side.values() for fb in runs])


__all__ = ["GATE_FAILED", "GATE_META", "decide_statistic", "hard_failure", "pool_runs", "side_feedback",
           "statistic_of"]
