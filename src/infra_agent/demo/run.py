"""The demo: a real agent run on refstack, driven by what the probes find.

1. Build the demo workspace (a git repository): knobs from ``refstack knobs --json``,
   a chat scenario, two absolute criteria, and case study A as a kernel check.  Its
   baseline is mis-set: ``max_running=2`` under 8 concurrent chats, and a tf32 LM head.
2. ``infra-agent run`` with the ``rules`` proposer: the baseline's gate table fails;
   the serving probe reports that queueing dominates TTFT at the scheduler, and the
   kernel check reports that TP shards disagree under tf32.  The playbook turns each
   finding into a hypothesis; the planner sends the kernel question to the kernel lab
   (tier check) and the scheduler question to an interleaved A/B (tier e2e); the judge
   decides.  The loop stops when every gate passes.
3. A confirmation A/B of the best against the baseline gives the gate table after, and
   the report is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from infra_agent.demo.build import build_demo_workspace
from infra_agent.records import Experiment, RunRecord


@dataclass
class DemoResult:
    workspace: Path
    run: RunRecord
    experiments: list[Experiment]
    report_html: Path | None
    report_markdown: Path | None

    @property
    def fixed(self) -> list[str]:
        """Gates that failed before and pass after."""
        before = {g.name: g.outcome for g in self.run.gates_before}
        return [g.name for g in self.run.gates_after if g.outcome == "pass" and before.get(g.name) == "fail"]

    def as_dict(self) -> dict[str, Any]:
        return {"workspace": str(self.workspace), "run": self.run.model_dump(mode="json"), "fixed": self.fixed,
                "experiments": [{"id": e.id, "role": e.role, "hypothesis": e.hypothesis.statement,
                                 "change": e.change.knobs, "probe": e.probe.name if e.probe else None,
                                 "tier": e.probe.tier.value if e.probe else None, "status": e.status,
                                 "verdict": e.verdict.outcome if e.verdict else None, "accepted": e.accepted,
                                 "wall_s": round(e.cost.wall_s, 2)} for e in self.experiments],
                "report": {"html": str(self.report_html) if self.report_html else None,
                           "markdown": str(self.report_markdown) if self.report_markdown else None}}


def run_demo(workdir: Path, pairs: int = 3, budget_runs: int = 6, console: Console | None = None,
             progress: bool = True, executor: str = "local", address: str | None = None) -> DemoResult:
    """Build the workspace in ``workdir`` and run the loop on it; ``executor`` and ``address``
    are ``infra-agent run``'s (``"ray"``: one Ray task per experiment, docs/distributed.md)."""
    from infra_agent.agent.runner import RunOptions, start_run
    from infra_agent.ledger import Ledger
    from infra_agent.report import write_report

    workdir = workdir.resolve()
    if console is not None:
        console.rule("[bold]workspace[/]: built from `refstack knobs --json`, baseline mis-set")
    yaml_path = build_demo_workspace(workdir)
    if console is not None:
        console.print(f"{yaml_path}", highlight=False)
        where = " on Ray" if executor == "ray" else ""
        console.rule(f"[bold]agent run[/]: rules proposer{where}, until every gate passes")
    opts = RunOptions(proposer="rules", budget_runs=budget_runs, pairs=pairs, executor=executor,  # type: ignore[arg-type]
                      address=address)
    run = start_run(workdir, opts, console=console, progress=progress)
    with Ledger.for_workspace(workdir) as ledger:
        exps = ledger.experiments(run.id)
    paths = write_report(run, exps, workdir / ".infra-agent" / "reports" / run.id)
    return DemoResult(workdir, run, exps, paths.html, paths.markdown)
