"""What each experiment was decided on: its paired ratio against its parent, with the interval.

The loop judges a candidate on the ratio candidate / parent of its hypothesis metric,
measured in interleaved pairs (A B A B), against the hypothesis's line
(``Hypothesis.ratio_threshold()``).  The report's headline plot draws exactly that, so
a point's place beside its line matches its verdict.  A count metric (``failed_checks``)
is decided exactly, as a count, not a ratio: it is kept apart (``kind == "count"``).  An
experiment that never produced a number (rejected, an error, a hypothesis left
unmeasured) is listed without one.  The confirmation (role ``confirm``) is the best
against the *baseline*, not its parent; it is drawn too, labelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from infra_agent.judge.gates import side_values
from infra_agent.records import COUNT_METRICS, Experiment
from infra_agent.report.fmt import fmt_interval, fmt_num

# accepted; supported but held back (a guard broke or stayed undecided, requests were lost);
# refuted; inconclusive; error (rejected, failed, timed out: no number); and the confirmation's two.
Outcome = Literal["accepted", "held", "refuted", "inconclusive", "error", "confirmed", "not_confirmed"]
OUTCOME_LABELS: dict[str, str] = {
    "accepted": "accepted", "held": "supported, held back", "refuted": "refuted", "inconclusive": "inconclusive",
    "error": "error / rejected (no ratio)", "confirmed": "confirmation: confirmed",
    "not_confirmed": "confirmation: not confirmed",
}
# The plot's marker shapes as text, for the Markdown: ● ◆ ✕ ○ △ and a star.
GLYPHS: dict[str, str] = {"accepted": "●", "held": "◆", "refuted": "✕", "inconclusive": "○", "error": "△",
                          "confirmed": "★", "not_confirmed": "☆"}
_OUTCOMES: dict[str, Outcome] = {"refuted": "refuted", "inconclusive": "inconclusive", "confirmed": "confirmed",
                                 "not_confirmed": "not_confirmed"}
_FAILED = ("error", "timeout", "rejected")


@dataclass(frozen=True)
class Decision:
    seq: int
    id: str
    outcome: Outcome
    kind: Literal["ratio", "count", "none"]  # what ``effect`` is; "none": nothing was measured
    metric: str
    scenario: str
    direction: str
    effect: float | None = None
    low: float | None = None
    high: float | None = None
    threshold: float | None = None  # the ratio the claim needs (kind "ratio")
    need: str = ""  # the line as words: "≥ 1.05", "≤ baseline - 1"
    interval: str = ""  # what the interval is
    confirm: bool = False  # the best against the baseline, not against its parent
    parent_count: float | None = None  # kind "count": the same count on the other side of the pair
    why: str = ""  # kind "none": why there is no number
    load: str = ""  # the machine load during its windows, one line (report/noise.py)

    @property
    def label(self) -> str:
        return f"{self.id} confirm" if self.confirm else self.id

    def count_text(self) -> str:
        """A count as the table and the tooltip print it: ``0 (count; parent 3; exact count)``."""
        other = "baseline" if self.confirm else "parent"
        notes = ["count", f"{other} {fmt_num(self.parent_count)}" if self.parent_count is not None else "", self.interval]
        return f"{fmt_num(self.effect)} ({'; '.join(n for n in notes if n)})"

    def describe(self) -> str:
        """One line for a tooltip or a table."""
        what = "best / baseline" if self.confirm else "candidate / parent"
        about = f" ({self.interval})" if self.interval else ""
        if self.kind == "ratio":
            body = f"{self.metric} {what} {fmt_num(self.effect)} {fmt_interval(self.low, self.high)}".rstrip() + about
        elif self.kind == "count":
            body = f"{self.metric} {self.count_text()}"
        else:
            body = self.why
        need = f"; needs {self.need}" if self.need else ""
        load = f"; {self.load}" if self.load else ""
        return f"{self.label} (seq {self.seq}) {OUTCOME_LABELS[self.outcome]}: {body}{need}{load}"


@dataclass
class Decisions:
    items: list[Decision] = field(default_factory=list)  # by seq
    note: str = ""  # why there is nothing to plot

    @classmethod
    def of(cls, decisions: Iterable[Decision]) -> Decisions:
        items = sorted(decisions, key=lambda d: (d.seq, d.id))
        return cls(items=items, note="" if items else "No experiment has a verdict yet: nothing was decided, "
                                                        "nothing to plot.")

    @property
    def ratios(self) -> list[Decision]:
        return [d for d in self.items if d.kind == "ratio"]

    @property
    def counts(self) -> list[Decision]:
        return [d for d in self.items if d.kind == "count"]

    @property
    def unmeasured(self) -> list[Decision]:
        return [d for d in self.items if d.kind == "none"]


def _outcome(e: Experiment) -> Outcome | None:
    v = e.verdict
    if v is None:
        return "error" if e.status in _FAILED else None
    if v.outcome == "supported":
        return "accepted" if v.accepted else "held"
    return _OUTCOMES.get(v.outcome)


def decision_of(e: Experiment, text: Callable[[object], str], load: str = "") -> Decision | None:
    """The decision ``e`` records, or None for the baseline, a look-again, or one not yet decided."""
    if e.role in ("baseline", "diagnose") or e.parent is None:
        return None
    outcome = _outcome(e)
    if outcome is None:
        return None
    h, v = e.hypothesis, e.verdict
    # The verdict carries the hypothesis gate's numbers; a confirmation keeps them only in that gate.
    hyp = next((g for g in v.gates if g.kind == "hypothesis"), None) if v is not None else None
    effect = v.effect if v is not None and v.effect is not None else (hyp.value if hyp else None)
    low = v.low if v is not None and v.effect is not None else (hyp.low if hyp else None)
    high = v.high if v is not None and v.effect is not None else (hyp.high if hyp else None)
    interval = (v.interval if v is not None and v.interval else (hyp.interval if hyp else ""))
    count = h.metric in COUNT_METRICS
    op = "≥" if h.direction == "higher" else "≤"
    need = (f"{op} baseline {'+' if h.direction == 'higher' else '-'} {h.min_effect:g}" if count
            else f"{op} {h.ratio_threshold():.4g}")
    base = Decision(seq=e.seq, id=text(e.id), outcome=outcome, kind="none", metric=text(h.metric),
                    scenario=text(h.scenario), direction=h.direction, confirm=e.role == "confirm", load=load)
    if effect is None:
        why = text(e.error or (v.message if v is not None else "") or e.status).strip()
        return replace(base, why=why.splitlines()[0][:200] if why else e.status)
    if count:
        # The parent's count, when its side is one run: a pooled Feedback keeps only its first run's count.
        other = e.baseline_feedback
        parent = side_values([other], h.metric) if other is not None and other.meta.get("runs", 1) == 1 else []
        return replace(base, kind="count", effect=effect, need=need, interval=text(interval),
                       parent_count=sum(parent) if parent else None)
    if effect <= 0:
        return replace(base, why=f"ratio {fmt_num(effect)} is not positive")
    # A ratio's interval is of a positive quantity; one that is not is drawn without its bar.
    lo, hi = (low, high) if low is not None and high is not None and 0 < low <= high else (None, None)
    return replace(base, kind="ratio", effect=effect, low=lo, high=hi, threshold=h.ratio_threshold(), need=need,
                   interval=text(interval))
