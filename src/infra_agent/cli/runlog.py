"""Shared by the run, resume, ls and report verbs: printing a run, writing its report, finding the ledger.

Heavy modules are imported inside the functions, so the verbs' modules stay light.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import typer

from infra_agent.cli.output import emit, err_console, user_errors

# Where ``infra_agent.ledger`` keeps a workspace's ledger (not imported: it pulls in pydantic models).
LEDGER_REL = Path(".infra-agent") / "ledger.db"
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def run_summary(run: Any, report: Any | None) -> dict[str, Any]:
    data = run.model_dump(mode="json")
    if report is not None:
        data["report"] = {"html": str(report.html), "markdown": str(report.markdown)}
    return data


def render_run(run: Any, report: Any | None, root: Path | None = None) -> Any:
    """Print a run: status and message, what was tried, the gate tables, what to do next, the report.

    ``root`` is the workspace folder (the record's own ``workspace`` may have been scrubbed
    of a path that looked secret)."""
    where = Path(root) if root is not None else Path(run.workspace)

    def render(con: Any) -> None:
        from infra_agent.agent.progress import gate_table

        colour = {"done": "green", "budget": "yellow", "error": "red", "interrupted": "yellow",
                  "not_confirmed": "red"}.get(run.status, "")
        status = f"[{colour}]{run.status}[/]" if colour else run.status
        con.print(f"run {run.id}: {status} — ", end="", highlight=False)
        con.print(run.message or "-", markup=False, highlight=False)
        exps = _experiments(run, where)
        if exps is not None:
            tried = [e for e in exps if e.role == "experiment"]
            accepted = [e for e in tried if e.accepted]
            best = next((e for e in exps if e.id == run.best), None)
            knobs: dict[str, Any] = {}
            for e in accepted:  # the accepted path, baseline to best
                knobs.update(e.change.knobs)
            change = ", ".join(f"{k}={v}" for k, v in knobs.items())
            if any(e.change.diff for e in accepted):
                change = f"{change} + code" if change else "code"
            best_text = "the baseline" if best is None or best.role == "baseline" else f"{best.id} ({change or 'as the baseline'})"
            con.print(f"{len(tried)} experiment(s), {len(accepted)} accepted; best: {best_text}", highlight=False)
            if not tried and run.status == "done" and run.gates_before:
                if all(g.outcome == "skipped" for g in run.gates_before):
                    why = ("every criterion is relative (ratio:), and holds on the baseline by definition, so nothing was "
                           "tried; add an absolute one (value:), or")
                else:
                    why = "the baseline already meets every criterion, so nothing was tried;"
                con.print(f"note: {why} pass --keep-going to look for improvements anyway (up to --budget-runs)",
                          highlight=False)
        if run.gates_before:
            con.print(gate_table(run.gates_before, "gates before (baseline)"))
        else:
            con.print("gates before: none (the baseline was not measured)", highlight=False)
        if run.gates_after:
            if (run.best is None or run.best == run.baseline) and run.gates_after == run.gates_before:
                con.print("gates after: as before (nothing was accepted)", highlight=False)
            else:
                con.print(gate_table(run.gates_after, "gates after (best vs baseline)"))
        if run.status == "interrupted":
            con.print(f"resume with: infra-agent resume {run.id} -w {where}", highlight=False, soft_wrap=True)
        elif run.status == "not_confirmed":
            con.print(f"top up the confirmation with: infra-agent resume {run.id} -w {where}", highlight=False, soft_wrap=True)
        elif run.status == "error":
            con.print(f"after fixing the cause, continue with: infra-agent resume {run.id} -w {where}", highlight=False, soft_wrap=True)
        if report is not None:
            con.print(f"report: {report.html}\n        {report.markdown}", highlight=False, soft_wrap=True)
    return render


def _experiments(run: Any, root: Path) -> list[Any] | None:
    """The run's experiments from its ledger, or None when the ledger cannot be read."""
    from infra_agent.errors import InfraAgentError
    from infra_agent.ledger import Ledger

    db = root / LEDGER_REL
    if not db.is_file():
        return None
    try:
        with Ledger(db) as ledger:
            return list(ledger.experiments(run.id))
    except InfraAgentError:
        return None


def workspace_root(workspace: Path) -> Path:
    """The workspace's folder; its ``infra-agent.yaml`` must load, unless a ledger is there already
    (``ls`` and ``report`` need only the ledger, so a later mistake in the YAML does not hide the runs)."""
    from infra_agent.errors import ConfigError
    from infra_agent.probes.workspace_checks import load_workspace

    try:
        return Path(load_workspace(workspace).root)
    except ConfigError:
        folder = workspace.parent if workspace.is_file() else workspace
        if (folder / LEDGER_REL).is_file():
            return folder.resolve()
        raise


def ledger_path(root: Path, run_id: str | None = None) -> Path:
    """The ledger of the workspace at ``root``; an error naming the folder when there is none (none is created)."""
    from infra_agent.errors import InfraAgentError

    db = root / LEDGER_REL
    if not db.is_file():
        what = f"no run {run_id!r}: " if run_id else ""
        raise InfraAgentError(f"{what}{root} has no ledger ({db} does not exist), so no run was started there; "
                              f"start one with `infra-agent run {root}`")
    return db


def write_run_report(run_id: str, workspace: Path) -> Any:
    from infra_agent.ledger import Ledger
    from infra_agent.report import write_report

    root = workspace_root(workspace)
    with Ledger(ledger_path(root, run_id)) as ledger:
        run = ledger.get_run(run_id)
        exps = ledger.experiments(run_id)
    return write_report(run, exps, root / ".infra-agent" / "reports" / run_id)


def exit_interrupted(exc: BaseException, as_json: bool) -> NoReturn:
    """Ctrl-C (or SIGTERM) ended the run: say how to resume it, exit 130; with ``--json`` stdout holds one JSON object."""
    run = getattr(exc, "run", None)
    root = getattr(exc, "root", None) or (run.workspace if run is not None else None)
    if run is not None:
        message = f"run {run.id} stopped; resume with `infra-agent resume {run.id} -w {root}`"
    else:
        message = "interrupted before the run started; nothing was recorded"
    if as_json:
        data: dict[str, Any] = {"error": "Interrupted", "message": message}
        if run is not None:
            data["run"] = run.model_dump(mode="json")
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    err_console.print(f"[bold yellow]interrupted:[/] {message}", markup=True, highlight=False, soft_wrap=True)
    raise typer.Exit(code=INTERRUPTED_EXIT)


def drive_run(start: Callable[[], Any], workspace: Path, no_report: bool, as_json: bool) -> None:
    """Drive a run (``run`` or ``resume``), write its report and print it.

    Exit status (agent/conclusion.py): 0 when every gate in the final table passes, 3 when the run
    ended with one that does not (failed, undecided, not confirmed), 1 when the run itself failed,
    130 when interrupted, 2 for a mistake."""
    with user_errors(as_json):
        try:
            record = start()
        except KeyboardInterrupt as exc:
            exit_interrupted(exc, as_json)
        report = None if no_report else write_run_report(record.id, workspace)
        root = workspace_root(workspace)
    emit(run_summary(record, report), as_json, render_run(record, report, root))
    from infra_agent.agent.conclusion import exit_code

    code = exit_code(record)
    if code:
        raise typer.Exit(code=code)
