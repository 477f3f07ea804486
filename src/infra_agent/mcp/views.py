"""The MCP session's read-only tools: the workspace as it is on disk, its knobs, and the ledger's
runs, experiments and findings.  Each takes the session first (``functools.partial`` binds it in
``McpSession._tools``); none starts a probe or changes the run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from infra_agent.errors import InfraAgentError
from infra_agent.safety import mask_values, workspace_secrets
from infra_agent.tools import experiment as exp_tools
from infra_agent.tools.registry import ToolContext, ToolResult

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession
    from infra_agent.mcp.tool_args import ListExperimentsArgs, NoArgs, ReadFindingsArgs
    from infra_agent.records import Experiment


def validate_workspace(session: McpSession, ctx: ToolContext, args: NoArgs) -> ToolResult:
    from infra_agent.probes.base import get_probe
    from infra_agent.probes.workspace_checks import load_workspace

    where = session.ws.source or session.ws.root
    try:
        ws = load_workspace(where)
    except InfraAgentError as exc:
        return ToolResult.fail(f"validate_workspace: {exc}", problem="invalid_workspace")
    problems: list[str] = []
    try:
        values = ws.resolve_knobs()
    except InfraAgentError as exc:
        values = {}
        problems.append(str(exc))
    checks = []
    for c in ws.checks:
        row: dict[str, Any] = {"name": c.name, "probe": c.probe, "components": list(c.components), "config": c.config}
        try:
            cls = get_probe(c.probe)
            rendered = c.render(values)
            if c.probe == "kernel":
                rendered = {"mode": "check", **rendered}
            row["tier"] = cls.tier(cls.parse_config(rendered, where=f"check {c.name!r}")).value
        except (InfraAgentError, KeyError, ValueError) as exc:
            problems.append(f"check {c.name!r}: {exc}")
        checks.append(row)
    data: dict[str, Any] = {
        "source": str(ws.source), "name": ws.name, "valid": not problems, "problems": problems,
        "target": target_summary(ws),
        "knobs": knob_rows(ws, values),
        "scenarios": {n: scenario_summary(s) for n, s in ws.scenarios.items()},
        "criteria": [{"name": c.name, "metric": c.metric, "scenario": c.scenario, "op": c.op, "value": c.value,
                      "ratio": c.ratio} for c in ws.criteria],
        "checks": checks,
        "protected": ws.protected_patterns,
    }
    lines = [f"workspace {ws.source}" + (f" ({ws.name})" if ws.name else "") + (": valid" if not problems else
             f": {len(problems)} problem(s)"), f"target: {data['target']}", "knobs:"]
    lines += [f"  {k['name']}: {k['domain']} default={k['default']} components={','.join(k['components']) or '-'}"
              for k in data["knobs"]]
    lines.append("scenarios:")
    lines += [f"  {n}: {s}" for n, s in data["scenarios"].items()]
    lines.append("criteria:")
    lines += [f"  {c['name']}: {c['metric']} {c['op']} " + (f"{c['ratio']:g} x baseline" if c["ratio"] is not None
                                                             else f"{c['value']:g}") + f" @{c['scenario']}"
              for c in data["criteria"]]
    lines.append("checks:" + ("" if checks else " none"))
    lines += [f"  {c['name']}: {c['probe']} probe, tier {c.get('tier', '?')}, components "
              f"{','.join(c['components']) or '-'}" for c in checks]
    lines.append("protected: " + ", ".join(data["protected"]))
    lines += [f"problem: {p}" for p in problems]
    if ws.model_dump() != session.ws.model_dump():
        lines.append("note: the file changed since this session loaded it; the session keeps the workspace it loaded")
    # The file as it is now may hold secrets the session's workspace does not (the registry masks those).
    secrets = workspace_secrets(ws)
    return ToolResult(text=mask_values("\n".join(lines), secrets), data=mask_values(data, secrets), error=bool(problems))


def list_knobs(session: McpSession, ctx: ToolContext, args: NoArgs) -> ToolResult:
    rows = knob_rows(session.ws, session.best_knobs())
    lines = [f"{len(rows)} knob(s)" + (f"; values are the current best's ({session.loop.state().best.id})"
                                       if session.loop is not None else "; values are the defaults")]
    for k in rows:
        lines.append(f"- {k['name']} = {k['value']!r}: {k['domain']} (default {k['default']!r}); components "
                     f"{', '.join(k['components']) or '-'}" + (f"; {k['help']}" if k["help"] else ""))
    return ToolResult(text="\n".join(lines), data={"knobs": rows})


def list_runs(session: McpSession, ctx: ToolContext, args: NoArgs) -> ToolResult:
    from infra_agent.agent.run_status import first_line, is_stale

    ledger = session.open_ledger()
    runs = ledger.list_runs()
    # The status `infra-agent ls` shows: a run whose owner process is gone is "stale", not "running".
    stale = {r.id for r in runs if is_stale(ledger, r)}
    rows = [{"id": r.id, "proposer": r.proposer, "status": "stale" if r.id in stale else r.status, "stale": r.id in stale,
             "recorded_status": r.status, "started_at": r.started_at, "baseline": r.baseline, "best": r.best,
             "message": r.message} for r in runs]
    lines = [f"{len(rows)} run(s) in {session.ledger.path}" + (f"; this session's run is {session.run.id}" if session.run else "")]
    lines += [f"- {r['id']} [{r['proposer']}] {r['status']} best={r['best'] or '-'}"
              + (f": {first_line(r['message'])}" if r["message"] else "") for r in rows]
    return ToolResult(text="\n".join(lines), data={"runs": rows})


def list_experiments(session: McpSession, ctx: ToolContext, args: ListExperimentsArgs) -> ToolResult:
    ledger = session.open_ledger()
    run_id = args.run or (session.run.id if session.run else None)
    if run_id is None:
        runs = ledger.list_runs()
        if not runs:
            return ToolResult(text="the ledger has no runs yet", data={"experiments": []})
        run_id = runs[0].id
    run = ledger.get_run(run_id)
    exps = ledger.experiments(run_id)
    shown = exps[-args.last_n:]
    rows = [exp_tools.experiment_summary(e) for e in shown]
    lines = [f"run {run_id} ({run.proposer}, {run.status}): {len(exps)} experiment(s); best {run.best or '-'}"
             + (f"; showing the last {len(shown)}" if len(shown) < len(exps) else "")]
    for row in rows:
        v = row["verdict"]
        verdict = "-" if v is None else f"{v['outcome']}{' accepted' if v['accepted'] else ''}"
        lines.append(f"- {row['id']} parent={row['parent'] or '-'} {row['status']} knobs={row['change']['knobs']}"
                     + (f" diff={row['change'].get('diff_paths')}" if "diff_paths" in row["change"] else "")
                     + f" | {row['hypothesis']} [{row['gate']}] -> {verdict}" + (f" ({row['error']})" if row["error"] else ""))
    return ToolResult(text="\n".join(lines), data={"run": run_id, "experiments": rows})


def experiment_run(session: McpSession, exp_id: str, run: str | None) -> str | None:
    """The run to look ``exp_id`` up in: ``run``, else this session's run when it holds it, else None
    (the ledger finds the one run that holds it, or says it is ambiguous)."""
    if run is None and session.run is not None and any(e.id == exp_id for e in session.open_ledger().experiments(session.run.id)):
        return session.run.id
    return run


def find_experiment(session: McpSession, exp_id: str, run: str | None) -> Experiment:
    return session.open_ledger().get_experiment(exp_id, experiment_run(session, exp_id, run))


def read_findings(session: McpSession, ctx: ToolContext, args: ReadFindingsArgs) -> ToolResult:
    ledger = session.open_ledger()
    run_id = experiment_run(session, args.experiment, args.run)
    sides = ("candidate", "baseline") if args.side == "both" else (args.side,)
    found = [(side, f) for side in sides for f in ledger.findings(args.experiment, side=side, run_id=run_id)]  # type: ignore[arg-type]
    rows = [{"side": side, **f.model_dump(mode="json", exclude_none=True)} for side, f in found]
    lines = [f"{len(rows)} finding(s) of experiment {args.experiment} ({args.side})"]
    for side, f in found:
        where = f" at {f.location}" if f.location is not None and str(f.location) else ""
        # Each line names its side: with both, a finding of the parent is not one of the change.
        lines.append(f"- {side}: [{f.severity}] {f.kind}{where}: {f.message}"
                     + (f" | next: {f.next_question}" if f.next_question else ""))
    return ToolResult(text="\n".join(lines), data={"experiment": args.experiment, "run": run_id, "findings": rows})


# ---------------------------------------------------------------- rendering helpers


def knob_rows(ws: Any, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"name": n, "type": k.type, "domain": k.domain(), "default": k.default, "value": values.get(n),
             "components": list(k.components), "help": k.help} for n, k in ws.knobs.items()]


def target_summary(ws: Any) -> str:
    t = ws.target
    if getattr(t, "url", None) and not getattr(t, "command", None):
        return f"endpoint {t.url}"
    command = t.command if isinstance(t.command, str) else " ".join(t.command)
    return f"server: {command}"


def scenario_summary(sc: Any) -> str:
    ds = sc.dataset
    data = f"{ds.kind}" + (f" in={ds.input_len}" if hasattr(ds, "input_len") else "") + \
           (f" out={ds.output_len}" if hasattr(ds, "output_len") else "")
    return f"{data}, {sc.num_requests} requests, concurrency {sc.max_concurrency or '-'}, endpoint {sc.endpoint}"


def measurement_row(m: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"name": m.name, "unit": m.unit, "value": m.summary.median if m.summary else None}
    if m.tags:
        row["tags"] = dict(m.tags)
    if m.summary is not None:
        row["n"] = m.summary.n
    return row
