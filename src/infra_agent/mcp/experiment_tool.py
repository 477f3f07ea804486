"""The MCP session's ``run_experiment`` tool: one hypothesis, with its change inline, through the loop.

The change (``knobs``, ``diff``) and the hypothesis are checked before anything is opened
or measured; the first call opens the session's run and measures the baseline; then the
step goes through ``Loop.run_step`` against the current best.  The same change as an open
experiment on the best (inconclusive, promising) is that experiment's top-up, not a refusal.

Apart from the session because it is the one tool that drives the run: the session holds
the state, this reads and advances it.  The result carries both sides, labelled
(:mod:`infra_agent.tools.sides`): the structured ``metrics`` rows hold the baseline's and the
candidate's values, ``findings`` say which side each came from, and the text gives each
side its share of the room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from infra_agent.errors import InfraAgentError
from infra_agent.mcp.progress import Heartbeat
from infra_agent.mcp.tool_args import McpRunExperimentArgs
from infra_agent.tools import code as code_tools
from infra_agent.tools import experiment as exp_tools
from infra_agent.tools.registry import ToolContext, ToolResult
from infra_agent.tools.sides import sides_data

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession

# The most characters of the verdict and both sides' text a result carries (the registry's
# bound is above it, so the result is never cut in its middle).
RESULT_CHARS = 10_000


def _stage_change(ctx: ToolContext, args: McpRunExperimentArgs) -> ToolResult | None:
    """The inline change merged into the pending one, checked as set_knobs and propose_diff do;
    an error result (the pending change as it was) when it fails."""
    before = ctx.pending
    if args.knobs is not None:
        res = exp_tools.set_knobs(ctx, exp_tools.SetKnobsArgs(knobs=args.knobs))
        if res.error:
            ctx.pending = before
            return ToolResult(text=res.text.replace("set_knobs:", "run_experiment: field 'knobs':", 1),
                              data=res.data, error=True)
    if args.diff is not None:
        res = code_tools.propose_diff(ctx, code_tools.ProposeDiffArgs(diff=args.diff))
        if res.error:
            ctx.pending = before
            return ToolResult(text=res.text.replace("propose_diff:", "run_experiment: field 'diff':", 1),
                              data=res.data, error=True)
    return None


def run_experiment(session: McpSession, ctx: ToolContext, args: McpRunExperimentArgs) -> ToolResult:
    from infra_agent.agent.proposers.llm_prompt import experiment_result

    if session.closed_reason is not None:
        return ToolResult.fail(f"run_experiment: this session's run is closed ({session.closed_reason}); start a new "
                               "session to run more experiments", problem="closed")
    if (refused := session.budget_refusal("run_experiment", experiment=True)) is not None:
        return refused
    if session.loop is not None:
        ctx.state = session.loop.state()
    before = ctx.pending
    if (failed := _stage_change(ctx, args)) is not None:
        return failed
    session.submitted = None
    hyp = exp_tools.RunExperimentArgs.model_validate(args.model_dump(exclude={"knobs", "diff"}))
    res = exp_tools.run_experiment(ctx, hyp)
    if res.error or session.submitted is None:
        if args.knobs is not None or args.diff is not None:
            ctx.pending = before
        return res
    loop = session.open_run()
    if not loop.ensure_baseline():
        ctx.pending = session.submitted.change  # kept for the next call
        return ToolResult.fail(f"run_experiment: {session.run.message if session.run else 'the baseline failed'}; "
                               "the next call measures the baseline again", problem="baseline")
    if not session.restored:
        # As `infra-agent run` does: make the run's branch hold the best's code.
        try:
            loop.executor.restore(loop.state().best)
        except InfraAgentError as exc:
            session.report(f"warning: could not restore the run's branch: {exc}")
        session.restored = True
    step, session.submitted = session.submitted, None
    known = {e.id for e in loop.history}
    session.experiments_run += 1
    beat = Heartbeat(session, "run_experiment", session.opts.heartbeat_s)
    try:
        exp = loop.run_step(step)
    finally:
        beat.close()
    state = loop.state()
    topped_up = exp.id in known
    summary = {**exp_tools.experiment_summary(exp), "best": state.best.id, "run": loop.run.id,
               "topped_up": topped_up, "gates": [g.model_dump(mode="json", exclude_none=True) for g in state.gates],
               **sides_data(exp)}
    note = (f"the same change as the open experiment {exp.id}: one more batch of it, judged on all its pairs\n"
            if topped_up else "")
    text = f"run {loop.run.id}: {note}" + experiment_result(exp, RESULT_CHARS) + f"\ncurrent best: {state.best.id}"
    # Never ran (screened out, or no probe could answer it): the call failed; a verdict, even a refuted one, did not.
    return ToolResult(text=text, data=summary, error=exp.probe is None and exp.status != "done")


__all__ = ["RESULT_CHARS", "run_experiment"]
