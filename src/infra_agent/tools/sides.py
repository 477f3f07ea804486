"""An experiment's two sides, labelled: the parent's (``baseline``) and the change's
(``candidate``) metrics side by side, each side's findings and trace files, as data and text.

Why apart from the feedback's own rendering: a ``run_experiment`` result used to be both
sides' rendered feedback cut in its middle to fit, which dropped the baseline's numbers
(the tail of the candidate's and the head of the baseline's went), and its structured
result held only the verdict.  Here every metric is one row holding both sides' values, so a
row never loses a side, and each side's findings get their own share of the room: a long
list on one side is cut, the other side is still there.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from infra_agent.feedback import Feedback, Finding, Measurement, Summary
from infra_agent.records import Experiment

SIDES = ("baseline", "candidate")
# The most findings of one side the structured result carries (the text fits its room).
MAX_FINDINGS = 50
# The least room a part of the text gets, however many parts share the limit.
_MIN_PART = 240


def side_feedbacks(e: Experiment) -> dict[str, Feedback]:
    """The sides that were measured, by label: ``baseline`` (the parent) and ``candidate`` (the change)."""
    found = {"baseline": e.baseline_feedback, "candidate": e.feedback}
    return {side: fb for side, fb in found.items() if fb is not None}


Key = tuple[str, tuple[tuple[str, str], ...]]


def _stat(m: Measurement) -> dict[str, Any]:
    s = m.summary if m.summary is not None or not m.samples else Summary.of(m.samples)
    out: dict[str, Any] = {"median": None, "n": 0} if s is None else \
        {"median": s.median, "ci_low": s.ci_low, "ci_high": s.ci_high, "p90": s.p90, "n": s.n}
    if "knob" in m.tags:
        out["knob"] = m.tags["knob"]
    return out


def _key(m: Measurement, *, knob: bool = True) -> Key:
    return m.name, tuple(sorted((k, v) for k, v in m.tags.items() if knob or k != "knob"))


def _pairs(base: list[Measurement], cand: list[Measurement]) -> list[tuple[Measurement | None, Measurement | None]]:
    """Each metric of the baseline with the candidate's same one: the same name and tags, or tags that
    differ only in ``knob`` (the serving probe tags the changed side ``knob=max_running=4``) when that
    match is the only one on each side.  A metric measured on one side only stands alone."""
    by_key = {_key(m): m for m in cand}
    exact = {_key(m) for m in base} & set(by_key)
    loose_b = Counter(_key(m, knob=False) for m in base if _key(m) not in exact)
    loose_c: dict[Key, list[Measurement]] = {}
    for k, m in by_key.items():
        if k not in exact:
            loose_c.setdefault(_key(m, knob=False), []).append(m)
    out: list[tuple[Measurement | None, Measurement | None]] = []
    used: set[int] = set()
    for m in base:
        if _key(m) in exact:
            out.append((m, by_key[_key(m)]))
            continue
        match = loose_c.get(_key(m, knob=False), [])
        one = match[0] if loose_b[_key(m, knob=False)] == 1 and len(match) == 1 else None
        used |= {id(one)} if one is not None else set()
        out.append((m, one))
    return out + [(None, m) for k, m in by_key.items() if k not in exact and id(m) not in used]


def metric_rows(e: Experiment) -> list[dict[str, Any]]:
    """One row per metric (name and tags): its unit, which way is better, each side's median with the
    interval of the median and the sample count (and the ``knob`` tag a side was measured under), and
    the ratio of the medians (candidate / baseline).  The hypothesis metric comes first.  The judge's
    verdict is on paired runs, not on this ratio."""
    fbs = side_feedbacks(e)
    pairs = _pairs(*(fbs[side].measurements if side in fbs else [] for side in SIDES))
    rows = []
    for b, c in pairs:
        first = b if b is not None else c
        assert first is not None
        row: dict[str, Any] = {"name": first.name, "unit": first.unit, "better": first.better,
                               "tags": dict(_key(first, knob=b is None or c is None or b.tags == c.tags)[1]),
                               "baseline": _stat(b) if b is not None else None,
                               "candidate": _stat(c) if c is not None else None, "ratio": None}
        x, y = (row[s]["median"] if row[s] else None for s in SIDES)
        if x is not None and y is not None and x != 0 and math.isfinite(x) and math.isfinite(y):
            row["ratio"] = y / x
        rows.append(row)
    metric = e.hypothesis.metric
    return sorted(rows, key=lambda r: r["name"] != metric)


def labelled_findings(e: Experiment, limit: int = MAX_FINDINGS) -> list[dict[str, Any]]:
    """Each side's findings (at most ``limit`` a side), each with the side it came from."""
    return [{"side": side, **f.model_dump(mode="json", exclude_none=True)}
            for side, fb in side_feedbacks(e).items() for f in fb.findings[:limit]]


def artifacts(fb: Feedback) -> list[dict[str, Any]]:
    """A side's files, each once (the windows of one server share its log)."""
    seen: dict[str, dict[str, Any]] = {}
    for a in fb.artifacts:
        seen.setdefault(a.path, a.model_dump(mode="json"))
    return list(seen.values())


def sides_data(e: Experiment) -> dict[str, Any]:
    """The structured form: ``sides`` (per side: the experiment it ran, ok, error, finding count,
    trace and log files), ``metrics`` (:func:`metric_rows`) and ``findings`` (:func:`labelled_findings`)."""
    ran = {"baseline": e.parent, "candidate": e.id}
    sides = {side: {"experiment": ran[side], "probe": fb.probe, "ok": fb.ok, "error": fb.error,
                    "runs": fb.meta.get("runs", 1), "findings": len(fb.findings), "artifacts": artifacts(fb)}
             for side, fb in side_feedbacks(e).items()}
    return {"sides": sides, "metrics": metric_rows(e), "findings": labelled_findings(e)}


# ---------------------------------------------------------------- text


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0 or not math.isfinite(x):
        return str(x)
    return f"{x:.3e}" if abs(x) >= 1e5 or abs(x) < 1e-3 else f"{x:.4g}"


def _metric_line(row: dict[str, Any]) -> str:
    tags = " ".join(f"{k}={v}" for k, v in sorted(row["tags"].items()))
    a, b = (row[s]["median"] if row[s] else None for s in SIDES)
    notes = [f"x{row['ratio']:.3g}"] if row["ratio"] is not None else []
    notes += [f"{row['better']} is better"] if row["better"] else []
    ratio = f" ({', '.join(notes)})" if notes else ""
    return f"  {row['name']}[{row['unit']}]{' ' + tags if tags else ''}: {_num(a)} -> {_num(b)}{ratio}"


def finding_lines(f: Finding) -> list[str]:
    loc = f" @ {f.location}" if f.location is not None and str(f.location) != "-" else ""
    ev = " ".join(f"{k}={_num(v) if isinstance(v, float) else v}" for k, v in f.evidence.items())
    lines = [f"  F[{f.severity}] {f.kind}: {f.message}{loc}" + (f" | {ev}" if ev else "")]
    if f.next_question:
        lines.append(f"    next: {f.next_question}")
    return lines


def _side_text(side: str, exp_id: str | None, fb: Feedback) -> str:
    head = f"{side} ({exp_id or '-'}) [{fb.tier.value}] {fb.probe}" + (" ok" if fb.ok else f" FAILED: {fb.error}")
    lines = [head, f"  findings: {len(fb.findings)}" if fb.findings else "  findings: none"]
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(fb.findings, key=lambda f: order.get(f.severity, 3)):
        lines += finding_lines(f)
    lines += [f"  A {a.kind}: {a.path}" for a in fb.artifacts if a.kind == "trace"]
    return "\n".join(lines)


def sides_text(e: Experiment, limit: int) -> str:
    """The metrics side by side, then each side's findings and trace files, in at most about ``limit``
    characters; every part keeps a share of the room (:func:`fit`), so neither side is ever dropped."""
    fbs = side_feedbacks(e)
    if not fbs:
        return ""
    ran = {"baseline": e.parent, "candidate": e.id}
    rows = metric_rows(e)
    table = (f"metrics, baseline ({e.parent or '-'}) -> candidate ({e.id}), medians; x = candidate/baseline:\n"
             + "\n".join(_metric_line(r) for r in rows)) if rows else "metrics: none"
    parts = [table, *(_side_text(side, ran[side], fb) for side, fb in fbs.items())]
    return "\n".join(fit(parts, limit))


def keep_head(text: str, limit: int) -> str:
    """``text`` cut to whole lines from its start, within ``limit`` characters, saying how many
    lines were left out (the first lines of a part are its most telling: a side's name, its
    hypothesis metric, its errors and warnings)."""
    if len(text) <= limit:
        return text
    lines = text.split("\n")
    kept: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > limit - 40:
            break
        kept.append(line)
        used += len(line) + 1
    if not kept:  # one line longer than the room: cut it
        return text[: max(limit - 40, 1)] + f" [... {len(text) - max(limit - 40, 1)} characters cut]"
    return "\n".join(kept) + f"\n  [... {len(lines) - len(kept)} more lines cut]"


def fit(parts: Sequence[str], limit: int) -> list[str]:
    """Each part cut (:func:`keep_head`) so that together they take about ``limit`` characters:
    a short part keeps all of it, and the room it leaves is shared by the longer ones; every part
    keeps at least a small share, so none is dropped."""
    out = list(parts)
    left = limit
    order = sorted(range(len(parts)), key=lambda i: len(parts[i]))
    for k, i in enumerate(order):
        share = max(left // (len(order) - k), _MIN_PART)
        out[i] = keep_head(parts[i], share)
        left -= len(out[i]) + 1
    return out


__all__ = ["MAX_FINDINGS", "SIDES", "artifacts", "finding_lines", "fit", "keep_head", "labelled_findings", "metric_rows",
           "side_feedbacks", "sides_data", "sides_text"]
