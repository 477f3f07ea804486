"""Shared by the run, resume, ls and report verbs: printing a run and writing its report.

Heavy modules are imported inside the functions, so the verbs' modules stay light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_summary(run: Any, report: Any | None) -> dict[str, Any]:
    data = run.model_dump(mode="json")
    if report is not None:
        data["report"] = {"html": str(report.html), "markdown": str(report.markdown)}
    return data


def render_run(run: Any, report: Any | None) -> Any:
    def render(con: Any) -> None:
        from infra_agent.agent.progress import gate_table

        con.print(f"run {run.id}: {run.status} — {run.message}", highlight=False)
        con.print(gate_table(run.gates_before, "gates before (baseline)"))
        con.print(gate_table(run.gates_after, "gates after (best vs baseline)"))
        if report is not None:
            con.print(f"report: {report.html}\n        {report.markdown}", highlight=False)
    return render


def write_run_report(run_id: str, workspace: Path) -> Any:
    from infra_agent.ledger import Ledger
    from infra_agent.report import write_report
    from infra_agent.workspace import load_workspace

    ws = load_workspace(workspace)
    with Ledger.for_workspace(ws.root) as ledger:
        run = ledger.get_run(run_id)
        exps = ledger.experiments(run_id)
    return write_report(run, exps, ws.root / ".infra-agent" / "reports" / run_id)
