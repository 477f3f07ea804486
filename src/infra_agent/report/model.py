"""The report's view model: computed once from a run and its experiments.

Every string in it has been through :func:`infra_agent.safety.scrub`, and every number
is already formatted, so the HTML and Markdown renderers only lay it out.  The
renderers read nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infra_agent.agent.conclusion import describe_gate, not_passing
from infra_agent.judge.effect_text import count_move
from infra_agent.records import EXACT_COUNT, Experiment, GateResult, RunRecord
from infra_agent.report.decisions import Decision, Decisions, decision_of
from infra_agent.report.fmt import fmt_duration, fmt_interval, fmt_num, fmt_time
from infra_agent.report.noise import Noise, load_note, noise_of
from infra_agent.report.series import Series, build_series
from infra_agent.safety import MASK, scrub, secret_name, secret_values

TOP_FINDINGS = 5
_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


class Scrubber:
    """Masks secrets in text and in JSON-like data, with the secret values read once."""

    def __init__(self) -> None:
        self.values = secret_values()

    def text(self, value: object) -> str:
        return "" if value is None else str(scrub(str(value), self.values))

    def data(self, value: Any) -> Any:
        """Like ``scrub`` on a mapping, but numbers and booleans under a key such as
        ``max_batch_tokens`` stay visible: only text can carry a credential."""
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            for k, v in value.items():
                key = self.text(k)
                out[key] = MASK if isinstance(v, str) and secret_name(str(k)) else self.data(v)
            return out
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        if isinstance(value, str):
            return self.text(value)
        return value


@dataclass(frozen=True)
class GateCell:
    outcome: str
    value: str
    interval: str
    label: str
    measured_in: str
    message: str


@dataclass(frozen=True)
class GateRow:
    name: str
    gate: str
    kind: str
    before: GateCell | None
    after: GateCell | None


@dataclass(frozen=True)
class FindingView:
    severity: str
    kind: str
    message: str
    location: str
    next_question: str
    evidence: str


@dataclass
class ExperimentView:
    id: str
    seq: int
    parent: str
    depth: int
    glyph: str  # the tree drawing before the id, e.g. "│  └─ "
    status: str
    error: str
    proposer: str
    statement: str
    metric: str
    direction: str
    min_effect: str
    scenario: str
    locality: str
    hypothesis_gate: str
    knobs: list[tuple[str, str]]
    diff: str
    description: str
    probe: str
    probe_tier: str
    probe_reason: str
    probe_config: str
    verdict: str  # supported / refuted / inconclusive, or "" when there is none
    effect: str
    effect_interval: str
    effect_label: str
    verdict_message: str
    gates: list[tuple[str, GateCell]]
    accepted: bool
    on_path: bool
    baseline: bool
    best: bool
    wall: str
    tier: str
    e2e_runs: int
    probe_runs: int
    llm_tokens: int
    launches: int  # server processes started (a refused one too); 0 in records from before they were counted
    findings: list[FindingView]
    more_findings: int
    noise: Noise  # the decision's interval width and the machine load during its windows
    node: str = ""  # where a Ray task ran it (and any node lost on the way); "" on this machine


@dataclass
class ReportModel:
    run_id: str
    workspace: str
    proposer: str
    status: str
    started: str
    finished: str
    wall: str
    n_experiments: int
    e2e_runs: int
    llm_tokens: int
    launches: int
    message: str
    baseline: str
    best: str
    branch: str
    gates: list[GateRow]
    experiments: list[ExperimentView]  # in tree order (depth first, children by seq)
    path: list[str]  # baseline → best
    decisions: Decisions  # the headline plot: each decision's paired ratio against its parent
    series: Series  # the secondary view: the absolute metric, best so far
    best_knobs: list[tuple[str, str]] = field(default_factory=list)
    # The final gate table's verdict (agent/conclusion.py), beside the status: "every gate passes",
    # or the gates that do not; empty while nothing was measured.
    final_gates: str = ""
    final_gates_met: bool = False

    @property
    def accepted(self) -> list[ExperimentView]:
        return [e for e in self.experiments if e.accepted]


def _gate_cell(g: GateResult, s: Scrubber) -> GateCell:
    # A count is compared exactly: its zero-width [0, 0] would read as a measured interval.
    interval, label = (f"({EXACT_COUNT})", "") if g.interval == EXACT_COUNT else \
        (fmt_interval(g.low, g.high), s.text(g.interval))
    return GateCell(outcome=g.outcome, value=fmt_num(g.value), interval=interval,
                    label=label, measured_in=s.text(g.measured_in), message=s.text(g.message))


def _gate_rows(before: list[GateResult], after: list[GateResult], s: Scrubber) -> list[GateRow]:
    """Before and after paired by gate name (the n-th of a repeated name with the n-th)."""
    def keyed(gates: list[GateResult]) -> dict[tuple[str, int], GateResult]:
        seen: dict[str, int] = {}
        out = {}
        for g in gates:
            n = seen[g.name] = seen.get(g.name, -1) + 1
            out[(g.name, n)] = g
        return out

    b, a = keyed(before), keyed(after)
    rows = []
    for key in [*b, *(k for k in a if k not in b)]:
        ref = b.get(key) or a[key]
        rows.append(GateRow(name=s.text(ref.name), gate=s.text(ref.gate), kind=ref.kind,
                            before=_gate_cell(b[key], s) if key in b else None,
                            after=_gate_cell(a[key], s) if key in a else None))
    return rows


def _tree(experiments: list[Experiment]) -> list[tuple[Experiment, int, str]]:
    """Depth-first order with depths and tree glyphs (``│  ├─ ``); an experiment whose
    parent is unknown is a root."""
    ids = {e.id for e in experiments}
    children: dict[str | None, list[Experiment]] = {}
    for e in sorted(experiments, key=lambda e: (e.seq, e.id)):
        children.setdefault(e.parent if e.parent in ids else None, []).append(e)
    out: list[tuple[Experiment, int, str]] = []
    # (experiment, depth, is the last of its siblings, the glyphs of its ancestors' columns)
    roots = children.get(None, [])
    stack = [(e, 0, i == len(roots) - 1, "") for i, e in reversed(list(enumerate(roots)))]
    seen: set[str] = set()
    while stack:
        e, depth, last, columns = stack.pop()
        if e.id in seen:
            continue
        seen.add(e.id)
        out.append((e, depth, columns + ("└─ " if last else "├─ ") if depth else ""))
        kids = children.get(e.id, [])
        below = columns + ("   " if last else "│  ") if depth else ""
        stack.extend((c, depth + 1, i == len(kids) - 1, below) for i, c in reversed(list(enumerate(kids))))
    # Cycles (which the loop never makes) would leave some out: list them as roots.
    out.extend((e, 0, "") for e in sorted(experiments, key=lambda e: e.seq) if e.id not in seen)
    return out


def accepted_path(run: RunRecord, experiments: list[Experiment]) -> list[str]:
    """The ids from the baseline to the best: the best's chain of parents."""
    by_id = {e.id: e for e in experiments}
    best = run.best if run.best in by_id else None
    if best is None:
        accepted = [e for e in experiments if e.accepted]
        best = max(accepted, key=lambda e: e.seq).id if accepted else run.baseline
    path: list[str] = []
    while best is not None and best in by_id and best not in path:
        path.append(best)
        best = by_id[best].parent
    return path[::-1]


def _findings(e: Experiment, s: Scrubber) -> tuple[list[FindingView], int]:
    fb = e.feedback or e.baseline_feedback
    if fb is None:
        return [], 0
    ranked = sorted(fb.findings, key=lambda f: _SEVERITY_RANK.get(f.severity, 3))
    views = []
    for f in ranked[:TOP_FINDINGS]:
        ev = " ".join(f"{k}={fmt_num(v) if isinstance(v, float) else v}" for k, v in s.data(f.evidence).items())
        views.append(FindingView(severity=f.severity, kind=s.text(f.kind), message=s.text(f.message),
                                 location=s.text(f.location) if f.location else "",
                                 next_question=s.text(f.next_question), evidence=ev))
    return views, max(0, len(fb.findings) - TOP_FINDINGS)


def _knob_list(knobs: Mapping[str, Any], s: Scrubber) -> list[tuple[str, str]]:
    clean = s.data(dict(knobs))
    return [(k, _knob_value(v)) for k, v in sorted(clean.items())]


def _knob_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return fmt_num(v) if isinstance(v, float) else str(v)


def _probe_of(e: Experiment, s: Scrubber) -> tuple[str, str, str]:
    """What measured an experiment: its planned probe, or, for the baseline and the
    confirmation (measured by the loop itself, no planner), the runs its cost records."""
    if e.probe is not None:
        return s.text(e.probe.name), e.probe.tier.value, s.text(e.probe.reason)
    c = e.cost
    if not (c.e2e_runs or c.probe_runs):
        return "", "", ""
    runs = [f"{c.e2e_runs} e2e run(s)" if c.e2e_runs else "", f"{c.probe_runs} check run(s)" if c.probe_runs else ""]
    why = f"the {e.role}'s own measurement: " if e.role in ("baseline", "confirm") else ""
    return ("serving" if c.e2e_runs else "checks", c.tier.value if c.tier else ("e2e" if c.e2e_runs else "check"),
            why + " + ".join(r for r in runs if r))


def _node(e: Experiment, s: Scrubber) -> str:
    """The Ray node that measured ``e`` (executors/ray_executor.py): address, node id, lost attempts."""
    for fb in (e.feedback, e.baseline_feedback):
        where = (fb.meta or {}).get("executor") if fb is not None else None
        if not isinstance(where, dict) or where.get("name") != "ray":
            continue
        text = f"{where.get('node') or '?'} (node {str(where.get('node_id') or '?')[:8]})"
        lost = [x for x in where.get("lost") or [] if isinstance(x, dict)]
        if lost:
            text += "; lost before: " + ", ".join(f"{x.get('node')} (node {str(x.get('node_id') or '?')[:8]})" for x in lost)
        return s.text(text)
    return ""


def _effect(e: Experiment, s: Scrubber) -> tuple[str, str, str]:
    """The verdict's effect, its interval and what that interval is.  A count shows its move
    (``3 → 0``, exact), not a ratio-style ``0 [0, 0]`` that reads as "no change"."""
    v = e.verdict
    if v is None:
        return "", "", ""
    move = count_move(e)
    if move is not None:
        return move, f"({EXACT_COUNT})", ""
    return fmt_num(v.effect), fmt_interval(v.low, v.high), s.text(v.interval)


def _experiment_view(e: Experiment, depth: int, glyph: str, path: list[str], run: RunRecord, s: Scrubber,
                     decision: Decision | None) -> ExperimentView:
    h, v, c = e.hypothesis, e.verdict, e.cost
    findings, more = _findings(e, s)
    probe, probe_tier, probe_reason = _probe_of(e, s)
    effect, effect_interval, effect_label = _effect(e, s)
    config = ""
    if e.probe is not None and e.probe.config:
        config = ", ".join(f"{k}={_knob_value(val)}" for k, val in s.data(e.probe.config).items())
    return ExperimentView(
        id=s.text(e.id), seq=e.seq, parent=s.text(e.parent), depth=depth, glyph=glyph, status=e.status, error=s.text(e.error),
        proposer=s.text(e.proposer), statement=s.text(h.statement), metric=s.text(h.metric), direction=h.direction,
        min_effect=fmt_num(h.min_effect), scenario=s.text(h.scenario), locality=s.text(h.locality),
        hypothesis_gate=s.text(h.gate_text()), knobs=_knob_list(e.change.knobs, s),
        diff=s.text(e.change.diff) if e.change.diff and e.change.diff.strip() else "",
        description=s.text(e.change.description),
        probe=probe, probe_tier=probe_tier, probe_reason=probe_reason, probe_config=config,
        verdict=v.outcome if v else "", effect=effect, effect_interval=effect_interval, effect_label=effect_label,
        verdict_message=s.text(v.message) if v else "",
        gates=[(s.text(g.gate or g.name), _gate_cell(g, s)) for g in (v.gates if v else [])],
        accepted=e.accepted, on_path=e.id in path, baseline=e.parent is None or e.id == run.baseline,
        best=bool(path) and e.id == path[-1],
        wall=fmt_duration(c.wall_s), tier=c.tier.value if c.tier else "", e2e_runs=c.e2e_runs,
        probe_runs=c.probe_runs, llm_tokens=c.llm_tokens, launches=c.launches, findings=findings, more_findings=more,
        noise=noise_of(e, decision), node=_node(e, s))


def build_model(run: RunRecord, experiments: list[Experiment]) -> ReportModel:
    s = Scrubber()
    path = accepted_path(run, experiments)
    decided = {e.id: decision_of(e, s.text, s.text(load_note(e))) for e in experiments}
    views = [_experiment_view(e, depth, glyph, path, run, s, decided[e.id]) for e, depth, glyph in _tree(experiments)]
    wall = run.finished_at - run.started_at if run.finished_at is not None else None
    by_id = {e.id: e for e in experiments}
    best = by_id.get(path[-1]) if path else None
    return ReportModel(
        run_id=s.text(run.id), workspace=s.text(run.workspace), proposer=s.text(run.proposer), status=run.status,
        started=fmt_time(run.started_at), finished=fmt_time(run.finished_at),
        wall=fmt_duration(wall) if wall is not None else "still running",
        n_experiments=len(experiments), e2e_runs=sum(e.cost.e2e_runs for e in experiments),
        llm_tokens=sum(e.cost.llm_tokens for e in experiments), launches=sum(e.cost.launches for e in experiments),
        message=s.text(run.message),
        baseline=s.text(run.baseline), best=s.text(path[-1]) if path else "", branch=s.text(run.branch),
        gates=_gate_rows(run.gates_before, run.gates_after, s), experiments=views, path=[s.text(p) for p in path],
        decisions=Decisions.of(d for d in decided.values() if d is not None),
        series=build_series(run, experiments, s.text), best_knobs=_knob_list(best.knobs, s) if best else [],
        final_gates=s.text(_final_gates(run)), final_gates_met=bool(run.gates_after) and not not_passing(run.gates_after)
        and run.status != "not_confirmed",
    )


def _final_gates(run: RunRecord) -> str:
    if not run.gates_after:
        return ""
    missing = not_passing(run.gates_after)
    passed = len(run.gates_after) - len(missing)
    if not missing:
        return f"every gate passes ({passed} of {len(run.gates_after)})"
    return f"{passed} of {len(run.gates_after)} gates pass: " + "; ".join(describe_gate(g) for g in missing)
