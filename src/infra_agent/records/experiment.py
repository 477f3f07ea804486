"""The experiment model: what the agent proposes, runs and records.

- ``Hypothesis``: one stated, falsifiable claim: the metric it predicts, the direction
  and the minimum effect, and the locality it is about (a ``Location``, the same
  vocabulary findings use).
- ``Change``: knob values and/or a unified diff against the workspace's code.
- ``ProbeCall``: the probe the planner chose, with its typed config (as JSON) and tier.
- ``Verdict``: supported / refuted / inconclusive, with the effect, its interval, and
  the outcome of every gate (the workspace's criteria and checks).
- ``Cost``: wall seconds, probe tier, e2e runs, server launches, LLM tokens.
- ``Experiment``: all of the above plus identity (id, parent) and status.

Accepted experiments form the path from the baseline to the current best (each one's
parent is the best at the time it was proposed); the others stay in the tree as
evidence.  Everything here is plain pydantic, JSON-serialisable, stored whole in the
ledger.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infra_agent.feedback import Feedback, Location, Tier
from infra_agent.records.gate import COUNT_METRICS, GateResult, GateSpec

Direction = Literal["higher", "lower"]
VerdictOutcome = Literal["supported", "refuted", "inconclusive"]
# The baseline and the final confirmation are measurements, not claims.
RecordOutcome = Literal["supported", "refuted", "inconclusive", "baseline", "confirmed", "not_confirmed", "diagnosed"]
Status = Literal["proposed", "running", "done", "rejected", "error", "timeout", "interrupted"]
# Statuses after which an experiment is never run again (resume skips them).
FINISHED: frozenset[str] = frozenset({"done", "rejected", "error", "timeout"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hypothesis(_Model):
    """A claim one experiment can support or refute."""

    statement: str = Field(min_length=1, description="the claim, in one sentence")
    metric: str = Field(min_length=1, description="the metric it predicts (a result key, e.g. output_throughput, "
                                                   "p99_ttft_ms, or a kernel metric such as failed_checks)")
    direction: Direction = Field(description="which way the metric moves if the claim holds")
    min_effect: float = Field(0.0, ge=0, description="smallest relative change that counts (0.05 = 5%); "
                                                     "for a count metric such as failed_checks, the absolute change")
    scenario: str | None = Field(None, description="the workspace scenario it is about (e2e metrics)")
    locality: Location = Field(default_factory=Location, description="what it is about: component, knob, kernel, "
                                                                     "variant, precision, thread or span")

    def gate_text(self) -> str:
        """The hypothesis as a gate: a ratio on candidate/baseline (``metric>=1.2``), or a
        difference for an exact count (``failed_checks <= baseline - 1``)."""
        op = ">=" if self.direction == "higher" else "<="
        if self.metric in COUNT_METRICS:
            return f"{self.metric} {op} baseline {'+' if self.direction == 'higher' else '-'} {self.min_effect:g}"
        return f"{self.metric}{op}{self.ratio_threshold():.6g}"

    def gate_spec(self) -> GateSpec:
        """The hypothesis as a gate: a ratio at the threshold :meth:`gate_text` prints (6
        significant digits), or for an exact count the absolute change."""
        op = ">=" if self.direction == "higher" else "<="
        threshold = self.min_effect if self.metric in COUNT_METRICS else float(f"{self.ratio_threshold():.6g}")
        return GateSpec(kind="hypothesis", metric=self.metric, op=op, threshold=threshold, scenario=self.scenario)

    def ratio_threshold(self) -> float:
        """The candidate/baseline ratio the claim needs: ``1 + min_effect`` up, ``1 / (1 + min_effect)`` down."""
        return 1 + self.min_effect if self.direction == "higher" else 1 / (1 + self.min_effect)


class Change(_Model):
    """What differs from the parent: knob values and/or a unified diff."""

    knobs: dict[str, bool | int | float | str] = Field(default_factory=dict)
    diff: str | None = Field(None, description="a unified diff against the parent's code (git apply format)")
    description: str = ""

    @property
    def empty(self) -> bool:
        return not self.knobs and not (self.diff and self.diff.strip())

    def key(self) -> str:
        """A stable identity for de-duplicating proposals."""
        import hashlib

        knobs = ",".join(f"{k}={v!r}" for k, v in sorted(self.knobs.items()))
        # A content hash, stable across processes (resume compares keys from the ledger).
        diff = hashlib.sha256(self.diff.strip().encode()).hexdigest()[:16] if self.diff and self.diff.strip() else ""
        return f"{knobs}|{diff}"


class ProbeCall(_Model):
    name: str
    config: dict[str, Any] = Field(default_factory=dict)
    tier: Tier
    reason: str = Field("", description="why the planner chose it (scope, cost)")
    check: str | None = Field(None, description="the workspace check it runs, once per side")


class Verdict(_Model):
    outcome: RecordOutcome
    effect: float | None = None  # candidate/baseline ratio of the hypothesis metric (the candidate's count for counts)
    low: float | None = None
    high: float | None = None
    interval: str = ""
    gates: list[GateResult] = Field(default_factory=list)
    accepted: bool = False
    # Supported, but a guard was left undecided: promising, not accepted (judge/accept.py).
    held: bool = False
    # False: the candidate did not serve what was asked (failed requests, answers of the wrong
    # length, other greedy text): its numbers are for other work, and more pairs would only
    # measure that again.
    served: bool = True
    message: str = ""

    @property
    def failed_gates(self) -> list[GateResult]:
        return [g for g in self.gates if g.outcome == "fail"]


class Cost(_Model):
    wall_s: float = 0.0
    tier: Tier | None = None
    e2e_runs: int = 0
    probe_runs: int = 0
    llm_tokens: int = 0
    # Server processes started: a server that refused its configuration ran no benchmark,
    # but its start was paid for (a record written before launches were counted reads 0).
    launches: int = 0

    def runs_text(self) -> str:
        """``3 e2e runs, 2 launches`` (launches left out when none were counted)."""
        text = f"{self.e2e_runs} e2e run{'' if self.e2e_runs == 1 else 's'}"
        return text + (f", {self.launches} launch{'' if self.launches == 1 else 'es'}" if self.launches else "")


class Experiment(_Model):
    id: str
    run_id: str
    seq: int
    parent: str | None = None  # None: the baseline itself
    proposer: str = ""
    # "diagnose": a look-again, the best re-measured for findings (agent/look_again.py).
    role: Literal["baseline", "experiment", "confirm", "diagnose"] = "experiment"
    hypothesis: Hypothesis
    change: Change = Field(default_factory=Change)
    probe: ProbeCall | None = None
    status: Status = "proposed"
    error: str | None = None
    # Feedback of the candidate side (and the baseline side when the probe ran both).
    feedback: Feedback | None = None
    baseline_feedback: Feedback | None = None
    # The workspace checks run on the candidate (cheap gates, or the check the
    # experiment was about), by check name.
    checks: dict[str, Feedback] = Field(default_factory=dict)
    verdict: Verdict | None = None
    # The sample-size plan stated before it ran (judge/sample_plan.py: noise, pairs needed,
    # the sequential design), as JSON.
    sample_plan: dict[str, Any] | None = None
    cost: Cost = Field(default_factory=Cost)
    # The knob values the candidate ran with (parent's config + this change), and the
    # code it ran: the parent's commit, and the commit made when it was accepted.
    knobs: dict[str, Any] = Field(default_factory=dict)
    base_commit: str | None = None
    commit: str | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def accepted(self) -> bool:
        return self.verdict is not None and self.verdict.accepted

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    @property
    def open(self) -> bool:
        """Undecided and promising: it may be topped up with more pairs later (the same run, a
        resumed one, an MCP client) instead of being refused as "already tried".  Inconclusive
        is not refuted: an interval that straddles the line with its estimate on the side the
        hypothesis predicts, or a supported hypothesis whose guard was left undecided."""
        v = self.verdict
        if self.role != "experiment" or self.status != "done" or v is None or v.accepted or not v.served:
            return False
        if v.held:
            return True
        if v.outcome != "inconclusive" or v.effect is None or v.low is None or self.hypothesis.metric in COUNT_METRICS:
            return False
        return v.effect > 1.0 if self.hypothesis.direction == "higher" else v.effect < 1.0


class Step(_Model):
    """What a proposer hands the loop: the question and the change; the planner picks the probe."""

    hypothesis: Hypothesis
    change: Change = Field(default_factory=Change)
    probe: str | None = Field(None, description="a probe name to force; None lets the planner choose")
    probe_config: dict[str, Any] = Field(default_factory=dict)
    rationale: str = ""
    llm_tokens: int = 0
