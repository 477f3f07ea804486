"""Diff of two runs' timelines: which spans and categories account for the E2E delta.

Durations are *self* times (a span's time minus its children's on the same thread),
so nested spans are not counted twice and the per-name deltas add up to the change
in busy time.  The E2E delta is the change in the window's length (first event to
last), or, with ``per``, the change per occurrence of a unit span (``per="engine.step"``
compares time per step when the runs served different amounts of work).  A span's
share is its delta over the E2E delta: shares above 1 mean other spans got faster.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from infra_agent.trace.model import NS_SLACK_US, Span, Timeline


def self_times(spans: list[Span]) -> list[tuple[Span, float]]:
    """(span, self µs): children are the spans nested in it on the same thread."""
    by_thread: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_thread[s.thread].append(s)
    out: list[tuple[Span, float]] = []
    for ss in by_thread.values():
        ss.sort(key=lambda s: (s.start_us, -s.end_us))
        stack: list[list] = []  # [span, child µs]
        for s in ss:
            # Back to back is not nesting (NS_SLACK_US).
            while stack and stack[-1][0].end_us <= s.start_us + NS_SLACK_US:
                top, child = stack.pop()
                out.append((top, max(0.0, top.dur_us - child)))
            if stack:
                stack[-1][1] += s.dur_us  # direct child of the top of the stack
            stack.append([s, 0.0])
        while stack:
            top, child = stack.pop()
            out.append((top, max(0.0, top.dur_us - child)))
    return out


@dataclass
class DeltaRow:
    key: str
    a_us: float
    b_us: float

    @property
    def delta_us(self) -> float:
        return self.b_us - self.a_us

    def to_dict(self, e2e_delta: float) -> dict[str, object]:
        return {"key": self.key, "a_us": self.a_us, "b_us": self.b_us, "delta_us": self.delta_us,
                "share_of_e2e_delta": self.delta_us / e2e_delta if e2e_delta else None}


@dataclass
class TimelineDiff:
    e2e_a_us: float
    e2e_b_us: float
    per: str | None
    units_a: int
    units_b: int
    spans: list[DeltaRow] = field(default_factory=list)
    categories: list[DeltaRow] = field(default_factory=list)

    @property
    def e2e_delta_us(self) -> float:
        return self.e2e_b_us - self.e2e_a_us

    def share(self, row: DeltaRow) -> float | None:
        return row.delta_us / self.e2e_delta_us if self.e2e_delta_us else None

    def to_dict(self) -> dict[str, object]:
        d = self.e2e_delta_us
        return {"e2e_a_us": self.e2e_a_us, "e2e_b_us": self.e2e_b_us, "e2e_delta_us": d, "per": self.per,
                "units_a": self.units_a, "units_b": self.units_b,
                "spans": [r.to_dict(d) for r in self.spans], "categories": [r.to_dict(d) for r in self.categories]}


def _totals(timeline: Timeline, per: str | None) -> tuple[float, int, dict[str, float], dict[str, float]]:
    spans = timeline.span_sources()
    units = sum(1 for s in spans if s.name == per) if per else 1
    div = float(max(units, 1))
    lo, hi = timeline.window()
    by_name: dict[str, float] = defaultdict(float)
    by_cat: dict[str, float] = defaultdict(float)
    for s, own in self_times(spans):
        by_name[s.name] += own / div
        by_cat[s.cat or s.name] += own / div
    e2e = (sum(s.dur_us for s in spans if s.name == per) if per else hi - lo) / div
    return e2e, units, by_name, by_cat


def diff(a: Timeline, b: Timeline, per: str | None = None) -> TimelineDiff:
    """Rank span names and categories by their share of the E2E delta (largest |delta| first)."""
    e2e_a, units_a, names_a, cats_a = _totals(a, per)
    e2e_b, units_b, names_b, cats_b = _totals(b, per)

    def rows(x: dict[str, float], y: dict[str, float]) -> list[DeltaRow]:
        keys = set(x) | set(y)
        return sorted((DeltaRow(k, x.get(k, 0.0), y.get(k, 0.0)) for k in keys), key=lambda r: -abs(r.delta_us))

    return TimelineDiff(e2e_a, e2e_b, per, units_a, units_b, rows(names_a, names_b), rows(cats_a, cats_b))


def diff_findings(d: TimelineDiff, top: int = 3) -> list:
    """The largest contributors to the delta as findings (DELTA_ATTRIBUTION)."""
    from infra_agent.feedback import Finding, Location
    from infra_agent.vocabulary import FindingKind

    out = []
    unit = f" per {d.per}" if d.per else ""
    for r in d.spans[:top]:
        share = d.share(r)
        if r.delta_us == 0:
            continue
        share_txt = f"{100 * share:.0f}% of the E2E delta" if share is not None else "the E2E time did not change"
        out.append(Finding(
            kind=FindingKind.DELTA_ATTRIBUTION, severity="info",
            message=f"span {r.key}: {r.a_us / 1e3:.3f} → {r.b_us / 1e3:.3f} ms{unit} (self time), {share_txt} "
                    f"({d.e2e_a_us / 1e3:.3f} → {d.e2e_b_us / 1e3:.3f} ms)",
            location=Location(span=r.key), evidence=r.to_dict(d.e2e_delta_us),
            next_question=f"What changed inside {r.key} between the runs? Trace its children or profile it."))
    return out
