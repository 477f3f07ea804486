"""The MCP session's ``run_probe`` tool: one probe on the workspace, outside any run.

The probe (a registered one, a dotted path, or a workspace check by name, whose config is
the base) is validated by its own Config before anything starts, then runs in the
executor's worker subprocess under the session's timeouts, with progress and a heartbeat
sent to the call's sink.  Nothing is judged or written to the ledger, which is why it is
apart from the session's run: it reads the session (workspace, options, budgets, the best
knobs) and changes only its probe count.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from infra_agent.mcp.progress import Heartbeat, describe_event
from infra_agent.mcp.tool_args import RunProbeArgs
from infra_agent.mcp.views import measurement_row
from infra_agent.tools.registry import ToolContext, ToolResult

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession

FEEDBACK_CHARS = 8000  # the most characters of a Feedback's text a tool result carries


def run_probe(session: McpSession, ctx: ToolContext, args: RunProbeArgs) -> ToolResult:
    from infra_agent.agent.executors.jobs import ProbeTimeout, run_job
    from infra_agent.errors import ConfigError
    from infra_agent.feedback import Feedback
    from infra_agent.probes.base import get_probe
    from infra_agent.safety import bound

    if (refused := session.budget_refusal("run_probe", experiment=False)) is not None:
        return refused
    ws, opts = session.ws, session.opts
    try:
        knobs = ws.resolve_knobs({**session.best_knobs(), **args.knobs})
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
    session.probes_run += 1
    job_id = f"p{session.probes_run}"
    source = ws.source or (ws.root / "infra-agent.yaml")
    what = f"probe {cls.name!r} ({tier.value})"
    session.report(f"{what} starts (timeout {timeout:g} s)")
    beat = Heartbeat(session, what, opts.heartbeat_s)
    t0 = time.monotonic()
    try:
        out = run_job(ws.root / ".infra-agent" / "mcp" / session.id, session.marker_run, job_id,
                      {"kind": "probe", "probe": probe_name, "config": config, "workspace": str(source),
                       "knobs": knobs}, timeout, lambda ev: session.report(describe_event(ev)), what)
    except ProbeTimeout as exc:
        return ToolResult.fail(f"run_probe: {exc}", problem="timeout", probe=cls.name)
    finally:
        beat.close()
    wall = time.monotonic() - t0
    if "feedback" not in out:
        return ToolResult.fail(f"run_probe: {what} could not run: {out.get('error', 'the probe worker failed')}",
                               problem="probe_failed", probe=cls.name)
    fb = Feedback.model_validate(out["feedback"])
    head = f"{what} {'ok' if fb.ok else 'FAILED'} in {wall:.1f} s with knobs " + \
           ", ".join(f"{k}={v}" for k, v in knobs.items())
    data = {"probe": cls.name, "tier": tier.value, "ok": fb.ok, "error": fb.error, "wall_s": round(wall, 2),
            "knobs": knobs, "measurements": [measurement_row(m) for m in fb.measurements],
            "findings": [f.model_dump(mode="json", exclude_none=True) for f in fb.findings[:50]]}
    return ToolResult(text=head + "\n" + bound(fb.render_text(), FEEDBACK_CHARS), data=data, error=not fb.ok)


__all__ = ["FEEDBACK_CHARS", "run_probe"]
