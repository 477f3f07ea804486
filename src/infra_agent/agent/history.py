"""What a run's history says about its best configuration: derived, never stored.

The accepted path, the gate table and the newest feedback are all functions of the
experiments in the ledger, so resume rebuilds them exactly.
"""

from __future__ import annotations

from infra_agent.feedback import Feedback
from infra_agent.judge.accept import update_table
from infra_agent.records import Experiment, GateResult


def by_id(history: list[Experiment], exp_id: str | None) -> Experiment | None:
    return next((e for e in history if e.id == exp_id), None)


def gate_table(history: list[Experiment], decisive: bool = False) -> dict[str, GateResult]:
    """The best configuration's gates (``decisive``: the last pass or fail of each, for the accept rule)."""
    table: dict[str, GateResult] = {}
    for e in history:
        if e.verdict and (e.role == "baseline" or e.verdict.accepted):
            table = update_table(table, e.verdict.gates, decisive)
    return table


def accepted_path(history: list[Experiment], best: Experiment) -> list[Experiment]:
    """The accepted path from the baseline to ``best``, baseline first."""
    path: list[Experiment] = []
    cur: Experiment | None = best
    while cur is not None:
        path.append(cur)
        cur = by_id(history, cur.parent)
    return path[::-1]


def latest_feedback(path: list[Experiment]) -> list[Feedback]:
    """What is known of the best configuration: the newest serving feedback and the newest run of
    each check along the accepted path (a check that passed later replaces one that failed)."""
    serving: Feedback | None = None
    checks: dict[str, Feedback] = {}
    for e in path:
        if e.feedback is not None and e.feedback.probe == "serving":
            serving = e.feedback
        checks.update(e.checks)
    return ([serving] if serving else []) + list(checks.values())
