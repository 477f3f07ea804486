"""The MCP session's ``run_probe`` tool: one probe on the workspace, or on an experiment's code, outside any run.

The probe (a registered one, a dotted path, or a workspace check by name, whose config is
the base) is validated by its own Config before anything starts, then runs in the
executor's worker subprocess under the session's timeouts, with progress and a heartbeat
sent to the call's sink.  With ``experiment`` it runs on that experiment's code and knob
values (:mod:`infra_agent.mcp.probe_code`).  Nothing is judged or written to the ledger,
which is why it is apart from the session's run: it reads the session (workspace, options,
budgets, the best knobs) and changes only its probe count and the Feedback it keeps per
call (``p1``, ``p2`` ...), whose trace files ``analyze_trace`` and ``diff_traces`` read.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infra_agent.mcp.probe_code import experiment_code, release, workspace_code
from infra_agent.mcp.progress import Heartbeat, describe_event
from infra_agent.mcp.tool_args import RunProbeArgs
from infra_agent.mcp.views import find_experiment, measurement_row
from infra_agent.tools.registry import ToolContext, ToolResult

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession

FEEDBACK_CHARS = 8000  # the most characters of a Feedback's text a tool result carries


def run_probe(session: McpSession, ctx: ToolContext, args: RunProbeArgs) -> ToolResult:
    from infra_agent.agent.executors.jobs import ProbeTimeout, run_job
    from infra_agent.errors import ConfigError, InfraAgentError
    from infra_agent.feedback import Feedback
    from infra_agent.probes.base import get_probe
    from infra_agent.safety import bound

    if (refused := session.budget_refusal("run_probe", experiment=False)) is not None:
        return refused
    ws, opts = session.ws, session.opts
    exp = find_experiment(session, args.experiment, args.run) if args.experiment is not None else None
    base = dict(exp.knobs) if exp is not None else session.best_knobs()
    try:
        knobs = ws.resolve_knobs({**base, **args.knobs})
    except ConfigError as exc:
        return ToolResult.fail(f"run_probe: field 'knobs': {exc}", problem="invalid_arguments")
    check = next((c for c in ws.checks if c.name == args.probe), None)
    probe_name = check.probe if check is not None else args.probe
    try:
        cls = get_probe(probe_name)
    except ConfigError as exc:
        return ToolResult.fail(f"run_probe: field 'probe': expected a probe ('serving', 'kernel', 'command', a "
                               f"dotted path) or a workspace check ({', '.join(c.name for c in ws.checks) or 'none'}), "
                               f"got {args.probe!r} ({exc})", problem="invalid_arguments")
    config = {**(check.render(knobs) if check is not None else {}), **args.config}
    try:
        cfg = cls.parse_config(config, where=f"run_probe config of the {cls.name} probe")
    except ConfigError as exc:
        return ToolResult.fail(f"run_probe: {exc}", problem="invalid_config")
    tier = cls.tier(cfg)
    limit = opts.probe_timeout_s if tier.value in ("e2e", "trace") else opts.check_timeout_s
    timeout = min(args.timeout_s or limit, opts.probe_timeout_s)
    job_id = f"p{session.probes_run + 1}"
    try:
        code = experiment_code(session, exp, job_id) if exp is not None else workspace_code(session)
    except InfraAgentError as exc:
        return ToolResult.fail(f"run_probe: field 'experiment': the code of {args.experiment} could not be checked "
                               f"out: {exc}", problem="no_code", experiment=args.experiment)
    session.probes_run += 1
    what = f"probe {cls.name!r} ({tier.value})"
    session.report(f"{what} [{job_id}] starts on {code.label} (timeout {timeout:g} s)")
    beat = Heartbeat(session, what, opts.heartbeat_s)
    t0 = time.monotonic()
    try:
        out = run_job(ws.root / ".infra-agent" / "mcp" / session.id, session.marker_run, job_id,
                      {"kind": "probe", "probe": probe_name, "config": config, "workspace": str(code.workspace_file),
                       "knobs": knobs}, timeout, lambda ev: session.report(describe_event(ev)), what)
    except ProbeTimeout as exc:
        return ToolResult.fail(f"run_probe: {exc}", problem="timeout", probe=cls.name, call=job_id)
    finally:
        beat.close()
        release(session, code)
    wall = time.monotonic() - t0
    if "feedback" not in out:
        return ToolResult.fail(f"run_probe: {what} could not run: {out.get('error', 'the probe worker failed')}",
                               problem="probe_failed", probe=cls.name, call=job_id)
    fb = Feedback.model_validate(out["feedback"])
    session.probe_feedback[job_id] = fb  # for analyze_trace and diff_traces
    head = f"{what} [{job_id}] {'ok' if fb.ok else 'FAILED'} in {wall:.1f} s on {code.label} with knobs " + \
           ", ".join(f"{k}={v}" for k, v in knobs.items())
    data = {"call": job_id, "probe": cls.name, "tier": tier.value, "ok": fb.ok, "error": fb.error,
            "wall_s": round(wall, 2), "knobs": knobs,
            "code": {"label": code.label, "experiment": code.experiment, "commit": code.commit},
            "measurements": [measurement_row(m) for m in fb.measurements],
            "findings": [f.model_dump(mode="json", exclude_none=True) for f in fb.findings[:50]],
            "artifacts": [a.model_dump(mode="json") for a in fb.artifacts]}
    return ToolResult(text=head + "\n" + bound(fb.render_text(), FEEDBACK_CHARS), data=data, error=not fb.ok)


__all__ = ["FEEDBACK_CHARS", "run_probe"]
