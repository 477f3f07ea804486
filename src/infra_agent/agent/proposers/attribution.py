"""Attribution: which knobs do the findings point at?

Every knob in ``infra-agent.yaml`` is tagged with the components it acts on; every
finding carries a ``Location``.  A knob scores from a finding when one of its
components is related (:func:`infra_agent.vocabulary.related`) to the finding's
component, and scores highest when the finding names the knob itself
(``location.knob``).  The score of one finding is

    severity weight (error 3, warning 2, info 1)
    x evidence share (``share`` in the evidence, e.g. queue/TTFT; 1 when absent)
    x scenario relevance (0.5 when gates fail, but none in the finding's scenario)
    x match

where ``match`` is the mean closeness of the knob's components to the finding's
component (1 for the same component, 1/2 one level apart, ...; 0 when unrelated).  A
knob that acts only where the finding points therefore ranks above one that spreads
over several components.  A knob named by a finding gets ``NAMED_WEIGHT`` instead of
``match`` and ranks before every knob that is not named.

The ranking is deterministic (ties broken by name) and explainable: each
``KnobScore`` keeps the findings that gave it its score.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from infra_agent.feedback import Finding
from infra_agent.records import GateResult
from infra_agent.vocabulary import related

SEVERITY_WEIGHT: dict[str, float] = {"error": 3.0, "warning": 2.0, "info": 1.0}
# A finding that names a knob speaks about it more directly than any component match (<= 1).
NAMED_WEIGHT = 4.0
# Findings from a scenario no failing gate is about still count, at this weight.
OFF_SCENARIO_WEIGHT = 0.5


@dataclass(frozen=True)
class Reason:
    """One finding's contribution to one knob's score."""

    kind: str
    where: str  # the finding's component, or "knob" when it names the knob
    severity: str
    points: float

    def __str__(self) -> str:
        at = "names it" if self.where == "knob" else f"at {self.where}"
        return f"{self.kind} {at} (+{self.points:.3g})"


@dataclass(frozen=True)
class KnobScore:
    name: str
    score: float = 0.0
    named: bool = False  # some finding names this knob in ``location.knob``
    reasons: tuple[Reason, ...] = field(default_factory=tuple)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The finding kinds that gave the score, strongest first, each once."""
        seen: dict[str, None] = {}
        for r in sorted(self.reasons, key=lambda r: -r.points):
            seen.setdefault(r.kind, None)
        return tuple(seen)

    def explain(self) -> str:
        """``queue_dominates_ttft at engine.scheduler`` (the strongest reasons, each kind once)."""
        parts: dict[str, str] = {}
        for r in sorted(self.reasons, key=lambda r: -r.points):
            parts.setdefault(r.kind, r.kind + (" names it" if r.where == "knob" else f" at {r.where}"))
        return ", ".join(parts.values())


def _depth(component: str) -> int:
    return component.count(".")


def closeness(knob_component: str, finding_component: str) -> float:
    """1 for the same component, 1/(1+d) for related ones d levels apart, else 0."""
    if not related(knob_component, finding_component):
        return 0.0
    return 1.0 / (1 + abs(_depth(knob_component) - _depth(finding_component)))


def _share(evidence: dict[str, Any]) -> float:
    share = evidence.get("share")
    if isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1:
        return float(share)
    return 1.0


def _gate_scenarios(gates: Iterable[GateResult]) -> set[str]:
    """Scenarios of the criterion gates (``metric>=x @scenario``, ``... @scenario x baseline``)."""
    out = set()
    for g in gates:
        if g.kind in ("absolute", "relative") and g.spec is not None and g.spec.scenario:
            out.add(g.spec.scenario)
    return out


def _named_knob(finding: Finding) -> str | None:
    if finding.location is None or not finding.location.knob:
        return None
    # Kernel findings write ``precision=tf32``; the knob is the part before '='.
    return finding.location.knob.partition("=")[0].strip()


def finding_weight(finding: Finding, failing_scenarios: set[str]) -> float:
    weight = SEVERITY_WEIGHT.get(finding.severity, 1.0) * _share(finding.evidence)
    scenario = finding.evidence.get("scenario")
    if failing_scenarios and isinstance(scenario, str) and scenario not in failing_scenarios:
        weight *= OFF_SCENARIO_WEIGHT
    return weight


def rank_knobs(workspace: Any, findings: list[Finding], failing_gates: list[GateResult]) -> list[KnobScore]:
    """Every knob of ``workspace`` with its score, highest first (named knobs first; ties by name)."""
    scenarios = _gate_scenarios(g for g in failing_gates if g.outcome == "fail")
    reasons: dict[str, list[Reason]] = {name: [] for name in workspace.knobs}
    named: set[str] = set()
    for f in findings:
        weight = finding_weight(f, scenarios)
        knob_name = _named_knob(f)
        if knob_name in reasons:
            assert knob_name is not None
            named.add(knob_name)
            reasons[knob_name].append(Reason(f.kind, "knob", f.severity, weight * NAMED_WEIGHT))
        component = f.location.component if f.location else None
        if not component:
            continue
        for name, knob in workspace.knobs.items():
            if name == knob_name or not knob.components:
                continue
            match = sum(closeness(c, component) for c in knob.components) / len(knob.components)
            if match > 0:
                reasons[name].append(Reason(f.kind, component, f.severity, weight * match))
    scores = [
        KnobScore(name=name, score=sum(r.points for r in rs), named=name in named, reasons=tuple(rs))
        for name, rs in reasons.items()
    ]
    # Round before comparing so float noise in the sums cannot reorder equal scores.
    scores.sort(key=lambda s: (not s.named, -round(s.score, 9), s.name))
    return scores
