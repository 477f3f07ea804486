"""The MCP session: the tool registry as it is, the environment's verbs, and one run in the ledger.

Nothing here imports the ``mcp`` package: ``McpSession.call(name, arguments, progress)``
takes a tool call as a client sent it and returns a ``ToolResult``, never raising;
:mod:`infra_agent.mcp.server` turns that into MCP.  Every call goes through one
``ToolRegistry``, so unknown tools, arguments that fail validation (named field,
expected, got), secret scrubbing and bounded output are the registry's, the same as
for the ``llm`` proposer.

Tools:

- the registry's: ``read_file``, ``search_code``, ``propose_diff``, ``set_knobs``,
  ``run_experiment``, ``read_ledger``, ``finish``.  ``run_experiment`` also takes the
  change inline (``knobs``, ``diff``: the same checks as ``set_knobs`` and
  ``propose_diff``) and returns the verdict;
- the environment's: ``validate_workspace``, ``list_knobs``, ``run_probe``,
  ``analyze_trace``, ``diff_traces``, ``list_runs``, ``list_experiments``,
  ``read_findings`` (the read-only ones in :mod:`infra_agent.mcp.views`, ``run_probe`` in
  :mod:`infra_agent.mcp.probe_tool` with the code it runs on in
  :mod:`infra_agent.mcp.probe_code`, the trace tools in :mod:`infra_agent.mcp.trace_tool`;
  their arguments in :mod:`infra_agent.mcp.tool_args`).  ``run_experiment`` is
  :mod:`infra_agent.mcp.experiment_tool`'s.

The run: the first ``run_experiment`` opens a run record in the workspace's ledger
(proposer ``mcp``), or resumes the one named by ``--run``, and measures the baseline;
each ``run_experiment`` then goes through the loop's own path
(``Loop.run_step``: screening, planner, local executor with git worktrees and
protected paths, judge, ledger) against the current best.  The session's budgets (a
number of experiments and wall seconds) are checked before anything starts.  Probes
and experiments run in the executor's worker subprocesses, with their timeouts and
cleanup; their JSON events, and a heartbeat while they run, go to ``progress``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback
from infra_agent.mcp import probe_code, views
from infra_agent.mcp.experiment_tool import run_experiment
from infra_agent.mcp.probe_tool import run_probe
from infra_agent.mcp.progress import SinkProgress
from infra_agent.mcp.tool_args import (
    AnalyzeTraceArgs,
    DiffTracesArgs,
    ListExperimentsArgs,
    McpRunExperimentArgs,
    NoArgs,
    ReadFindingsArgs,
    RunProbeArgs,
)
from infra_agent.mcp.trace_tool import analyze_trace, diff_traces
from infra_agent.records import Experiment, RunRecord, Step
from infra_agent.tools import code as code_tools
from infra_agent.tools import experiment as exp_tools
from infra_agent.tools.registry import (
    Tool,
    ToolContext,
    ToolRegistry,
    ToolResult,
)

log = logging.getLogger(__name__)

PROPOSER = "mcp"
# Seconds between "still running" progress messages while a probe or experiment runs.
HEARTBEAT_S = 5.0

Progress = Callable[[str], None]


class McpOptions(BaseModel):
    """The ``mcp`` verb's options; budgets are per session."""

    model_config = ConfigDict(extra="forbid")

    budget_runs: int | None = Field(8, ge=1, description="most experiments this session may run")
    budget_s: float | None = Field(None, gt=0, description="wall seconds after which no probe or experiment starts")
    pairs: int = Field(3, ge=3, le=50)
    probe_timeout_s: float = Field(900.0, gt=0)
    check_timeout_s: float = Field(300.0, gt=0)
    run: str | None = Field(None, description="a run of the ledger to continue instead of opening a new one")
    heartbeat_s: float = Field(HEARTBEAT_S, gt=0)


# ---------------------------------------------------------------- the session


class McpSession:
    """One server process's state: the workspace, the registry's context, and (once opened) the run."""

    def __init__(self, workspace: str | Path, options: McpOptions | None = None) -> None:
        from infra_agent.probes.workspace_checks import load_workspace

        self.opts = options or McpOptions()
        self.ws = load_workspace(workspace)
        self.id = time.strftime("m%Y%m%d-%H%M%S-") + secrets.token_hex(2)
        self.started = time.monotonic()
        self.experiments_run = 0
        self.probes_run = 0
        self.ctx = ToolContext(code_root=self.ws.root, workspace=self.ws, protected=list(self.ws.protected_patterns),
                               submit_step=self._submit)
        self.registry = ToolRegistry(self._tools())
        self.loop: Any = None  # infra_agent.agent.loop.Loop, once the run is open
        self.ledger: Any = None
        self.run: RunRecord | None = None
        self.closed_reason: str | None = None  # set by finish: no more experiments in this session
        self.submitted: Step | None = None
        self._lock = threading.Lock()  # one tool call at a time: the loop and the context are not shared
        self._sink: Progress | None = None
        self.restored = False
        # Each run_probe call's Feedback, by call (p1, p2 ...): the trace tools read their files.
        self.probe_feedback: dict[str, Feedback] = {}

    # ------------------------------------------------------------ calls

    def specs(self) -> list[dict[str, Any]]:
        return self.registry.specs()

    def call(self, name: str, arguments: str | Mapping[str, Any] | None, progress: Progress | None = None) -> ToolResult:
        """Run one tool call; every failure is an error result.  Calls are serialised."""
        with self._lock:
            self._sink = progress
            try:
                if self.loop is not None:
                    self.ctx.state = self.loop.state()
                result = self.registry.call(name, arguments, self.ctx)
                if name == "finish" and not result.error and self.ctx.finished is not None:
                    self._finish_run(f"finished: {self.ctx.finished}")
                return result
            finally:
                self._sink = None

    def report(self, message: str) -> None:
        sink = self._sink
        if sink is None:
            return
        from infra_agent.safety import mask_values, workspace_secrets

        try:
            sink(mask_values(message, workspace_secrets(self.ws))[:500])
        except Exception:
            log.debug("progress sink failed", exc_info=True)

    def close(self) -> list[str]:
        """End the session: kill what its probes and experiments left, and close the run record."""
        from infra_agent.agent.executors.cleanup import kill_marked

        found: list[str] = []
        n = kill_marked(f"{self.marker_run}/")
        if n:
            found.append(f"{n} probe process(es)")
        if probe_code.remove_all(self):
            found.append("probe worktree(s)")
        if self.loop is not None:
            found += self.loop.executor.cleanup()
            if self.run is not None and self.run.status == "running":
                self._finish_run(f"the MCP session ended after {self.experiments_run} experiment(s)")
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        return found

    # ------------------------------------------------------------ budgets

    def seconds_left(self) -> float | None:
        s = self.opts.budget_s
        return None if s is None else s - (time.monotonic() - self.started)

    def budget_refusal(self, what: str, experiment: bool) -> ToolResult | None:
        left = self.seconds_left()
        if left is not None and left <= 0:
            return ToolResult.fail(f"{what}: the session's wall budget of {self.opts.budget_s:g} s is spent; "
                                   "nothing more starts in this session", problem="budget")
        if experiment and self.opts.budget_runs is not None and self.experiments_run >= self.opts.budget_runs:
            return ToolResult.fail(f"{what}: the session's experiment budget is spent ({self.experiments_run} of "
                                   f"{self.opts.budget_runs} run)", problem="budget")
        return None

    # ------------------------------------------------------------ the run

    @property
    def marker_run(self) -> str:
        return f"mcp-{self.id}"

    def open_ledger(self) -> Any:
        if self.ledger is None:
            from infra_agent.ledger import Ledger

            self.ledger = Ledger.for_workspace(self.ws.root)
        return self.ledger

    def open_run(self) -> Any:
        """The session's loop: a new run record (proposer ``mcp``), or the one named by ``--run``."""
        if self.loop is not None:
            return self.loop
        from infra_agent.agent.executors.local import LocalExecutor
        from infra_agent.agent.loop import Loop
        from infra_agent.agent.planner import Planner
        from infra_agent.agent.runner import _exclude_from_git, new_run_id

        ledger = self.open_ledger()
        options = {"budget_runs": self.opts.budget_runs, "budget_s": self.opts.budget_s, "pairs": self.opts.pairs,
                   "probe_timeout_s": self.opts.probe_timeout_s, "check_timeout_s": self.opts.check_timeout_s,
                   "scenarios": None, "confirm": False, "keep_going": True}
        _exclude_from_git(self.ws.root)
        if self.opts.run:
            run = ledger.get_run(self.opts.run)
            if run.proposer != PROPOSER:
                raise InfraAgentError(f"run {run.id} was made by the {run.proposer} proposer; continue it with "
                                      f"`infra-agent resume {run.id}`, or leave --run out to open a new run")
            LocalExecutor(self.ws, run.id).cleanup()  # what a dead session left
            for exp in ledger.experiments(run.id):
                if not exp.finished:
                    exp.status = "interrupted"
                    ledger.save_experiment(exp)
            run.status, run.finished_at = "running", None
            run.options = {**run.options, **{k: v for k, v in options.items() if k != "elapsed_s"}}
            ledger.save_run(run)
        else:
            run = RunRecord(id=new_run_id(), workspace=str(self.ws.root), proposer=PROPOSER, started_at=time.time(),
                            options=options, message=f"MCP session {self.id}")
            ledger.create_run(run)
        executor = LocalExecutor(self.ws, run.id, pairs=self.opts.pairs, timeout_s=self.opts.probe_timeout_s,
                                 check_timeout_s=self.opts.check_timeout_s)
        planner = Planner(self.ws, ledger.probe_costs(), None)
        self.run = run
        self.loop = Loop(self.ws, ledger, run, _SubmittedStep(), executor, planner, SinkProgress(self))
        return self.loop

    def _finish_run(self, message: str) -> None:
        loop, run = self.loop, self.run
        self.closed_reason = message
        if loop is None or run is None:
            return
        from infra_agent.agent.conclusion import StopKind, StopReason, conclude

        run.options["elapsed_s"] = run.options.get("elapsed_s", 0.0) + time.monotonic() - loop.started
        run.gates_after = list(loop.state().gates)
        # The session's message names the gates its final table does not pass, as a run's does.
        ending = conclude(StopReason(StopKind.NOTHING_LEFT, message), run.gates_after, None, run, loop.history)
        run.status, run.message, run.finished_at = ending.status, ending.message, time.time()
        self.ledger.save_run(run)

    def _submit(self, step: Step) -> None:
        self.submitted = step

    # ------------------------------------------------------------ tools

    def _tools(self) -> list[Tool]:
        registry_tools = {t.name: t for t in (*code_tools.TOOLS, *exp_tools.TOOLS)}
        run_tool = registry_tools["run_experiment"]
        tools = [t for t in registry_tools.values() if t.name != "run_experiment"]
        tools.insert(len(code_tools.TOOLS) + 1, Tool(
            "run_experiment", run_tool.description + " The change may be given inline (knobs, diff) or built first with "
            "set_knobs and propose_diff. It runs through the planner, the executor (git worktree for a diff, protected "
            "paths), the judge and the ledger, against the current best; the first call measures the baseline.",
            McpRunExperimentArgs, partial(run_experiment, self)))
        return [
            Tool("validate_workspace", "Load and validate the workspace (infra-agent.yaml) as it is on disk now; list its "
                 "target, knobs (domains, components), scenarios, criteria, checks and protected paths.",
                 NoArgs, partial(views.validate_workspace, self)),
            Tool("list_knobs", "List the knobs: type and domain, default, the value the current best runs with, the "
                 "components each affects.", NoArgs, partial(views.list_knobs, self)),
            Tool("run_probe", "Run one probe on the workspace (its code as it is, with the given knob values), or on "
                 "an experiment's code (experiment: its accepted commit, else its parent's commit with its diff, in a git "
                 "worktree) in a worker subprocess with a timeout, and return its Feedback (measurements, findings, "
                 "trace files). Nothing is judged or recorded in the ledger; the call is named (p1, p2, ...) for "
                 "analyze_trace and diff_traces.", RunProbeArgs, partial(run_probe, self)),
            Tool("analyze_trace", "Analyse the traces a probe saved (a run_probe call, an experiment's side, or trace "
                 "files) again, without running anything: per-thread time, every sampled thread's states (running, "
                 "waiting for the GIL, blocked off it, with the call site), waits for the GIL and who held it, "
                 "findings.", AnalyzeTraceArgs, partial(analyze_trace, self)),
            Tool("diff_traces", "Diff the span traces of two windows (an experiment's baseline and candidate sides, or "
                 "any two sources): spans and categories ranked by their share of the end-to-end delta.",
                 DiffTracesArgs, partial(diff_traces, self)),
            *tools,
            Tool("list_runs", "List the runs in the workspace's ledger, newest first.", NoArgs, partial(views.list_runs, self)),
            Tool("list_experiments", "List a run's experiments from the ledger: hypothesis, change, verdict, cost.",
                 ListExperimentsArgs, partial(views.list_experiments, self)),
            Tool("read_findings", "Read one experiment's findings from the ledger (kind, severity, location, evidence, "
                 "the next question to ask).", ReadFindingsArgs, partial(views.read_findings, self)),
        ]

    def best_knobs(self) -> dict[str, Any]:
        if self.loop is not None:
            return dict(self.loop.state().best.knobs)
        try:
            return dict(self.ws.resolve_knobs())
        except InfraAgentError:
            return {}


class _SubmittedStep:
    """The loop's proposer in an MCP session: steps come from tool calls, so it never proposes."""

    name = PROPOSER
    stopped_reason: str | None = None

    def propose(self, state: Any) -> Step | None:
        return None

    def observe(self, state: Any, experiment: Experiment) -> None:
        return None

