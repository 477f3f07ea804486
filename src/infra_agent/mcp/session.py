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
  ``list_runs``, ``list_experiments``, ``read_findings``.

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
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from infra_agent.agent.experiment import Experiment, RunRecord, Step
from infra_agent.agent.progress import RunProgress
from infra_agent.errors import InfraAgentError
from infra_agent.tools import code as code_tools
from infra_agent.tools import experiment as exp_tools
from infra_agent.tools.registry import (
    Tool,
    ToolArgs,
    ToolContext,
    ToolRegistry,
    ToolResult,
)

log = logging.getLogger(__name__)

PROPOSER = "mcp"
# Seconds between "still running" progress messages while a probe or experiment runs.
HEARTBEAT_S = 5.0
_FEEDBACK_CHARS = 8000

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


# ---------------------------------------------------------------- tool arguments


class NoArgs(ToolArgs):
    pass


class RunProbeArgs(ToolArgs):
    probe: str = Field(min_length=1, description="a probe ('serving', 'kernel', 'command', a dotted path to a Probe "
                                                 "class) or the name of a workspace check (its config is the base)")
    config: dict[str, Any] = Field(default_factory=dict, description="the probe's typed config (validated by the "
                                                                     "probe's Config; unknown keys are refused)")
    knobs: dict[str, bool | int | float | str] = Field(default_factory=dict, description="knob values to run with, "
                                                                                        "over the current best's")
    timeout_s: float | None = Field(None, gt=0, description="kill the probe after this long (at most the session's "
                                                            "probe timeout)")


class McpRunExperimentArgs(exp_tools.RunExperimentArgs):
    """The registry's run_experiment (one hypothesis) with the change inline."""

    knobs: dict[str, bool | int | float | str | None] | None = Field(
        None, description="knob values to test (as set_knobs: checked against each knob's domain; merged into the "
                          "pending change)")
    diff: str | None = Field(None, description="a unified diff in git format to test (as propose_diff: checked with "
                                               "git apply --check and the protected paths)")


class ListExperimentsArgs(ToolArgs):
    run: str | None = Field(None, description="a run id (default: this session's run, else the newest run)")
    last_n: int = Field(20, ge=1, le=500, description="how many of the latest experiments to list")


class ReadFindingsArgs(ToolArgs):
    experiment: str = Field(min_length=1, description="an experiment id, e.g. e1")
    run: str | None = Field(None, description="its run id (default: this session's run, else the run that holds it)")
    side: Literal["candidate", "baseline", "both"] = Field("candidate", description="which side's findings")


# ---------------------------------------------------------------- progress


class _SinkProgress(RunProgress):
    """The loop's progress view, sent to the current call's progress sink instead of a terminal."""

    def __init__(self, session: McpSession) -> None:
        super().__init__(None, enabled=False)
        self._session = session

    def line(self, text: str) -> None:
        self._session.report(text)

    def event(self, ev: dict[str, Any]) -> None:
        self._session.report(describe_event(ev))

    def experiment(self, exp: Experiment, probe: str) -> None:
        self._session.report(f"{exp.id} start: {exp.hypothesis.statement} | {probe}")

    def finished(self, exp: Experiment, best: Experiment, gates: list[Any]) -> None:
        v = exp.verdict
        outcome = v.outcome if v else exp.status
        self._session.report(f"{exp.id} {outcome}{' (accepted)' if v and v.accepted else ''}; best is {best.id}")


def describe_event(ev: Mapping[str, Any]) -> str:
    """One worker event (``start``, ``run``, ``probe``) as a line of progress."""
    kind = ev.get("event")
    if kind == "start":
        return f"starting server {str(ev.get('side', '')).upper()}"
    if kind == "run":
        thr = ev.get("output_throughput")
        res = f"{thr:.1f} tok/s" if isinstance(thr, (int, float)) else ("ok" if ev.get("ok") else f"failed: {ev.get('error')}")
        return f"{ev.get('scenario')} window {int(ev.get('pair', 0)) + 1} side {str(ev.get('side', '')).upper()}: {res}"
    if kind == "probe":
        return f"probe {ev.get('probe')}: " + ("ok" if ev.get("ok") else f"failed: {str(ev.get('error'))[:200]}")
    return str(dict(ev))[:200]


class _Heartbeat:
    """Reports ``what`` every ``every_s`` seconds until closed."""

    def __init__(self, session: McpSession, what: str, every_s: float) -> None:
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._beat, args=(session, what, every_s), daemon=True)
        self._thread.start()

    def _beat(self, session: McpSession, what: str, every_s: float) -> None:
        while not self._stop.wait(every_s):
            session.report(f"{what}: running, {time.monotonic() - self._t0:.0f} s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


# ---------------------------------------------------------------- the session


class McpSession:
    """One server process's state: the workspace, the registry's context, and (once opened) the run."""

    def __init__(self, workspace: str | Path, options: McpOptions | None = None) -> None:
        from infra_agent.workspace import load_workspace

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
        self._submitted: Step | None = None
        self._lock = threading.Lock()  # one tool call at a time: the loop and the context are not shared
        self._sink: Progress | None = None
        self._restored = False

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
        from infra_agent.safety import scrub_text

        try:
            sink(scrub_text(message)[:500])
        except Exception:
            log.debug("progress sink failed", exc_info=True)

    def close(self) -> list[str]:
        """End the session: kill what its probes and experiments left, and close the run record."""
        from infra_agent.agent.executors.cleanup import kill_marked

        found: list[str] = []
        n = kill_marked(f"{self._marker_run}/")
        if n:
            found.append(f"{n} probe process(es)")
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

    def _budget_refusal(self, what: str, experiment: bool) -> ToolResult | None:
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
    def _marker_run(self) -> str:
        return f"mcp-{self.id}"

    def _open_ledger(self) -> Any:
        if self.ledger is None:
            from infra_agent.ledger import Ledger

            self.ledger = Ledger.for_workspace(self.ws.root)
        return self.ledger

    def _open_run(self) -> Any:
        """The session's loop: a new run record (proposer ``mcp``), or the one named by ``--run``."""
        if self.loop is not None:
            return self.loop
        from infra_agent.agent.executors.local import LocalExecutor
        from infra_agent.agent.loop import Loop
        from infra_agent.agent.planner import Planner
        from infra_agent.agent.runner import _exclude_from_git, new_run_id

        ledger = self._open_ledger()
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
        self.loop = Loop(self.ws, ledger, run, _SubmittedStep(), executor, planner, _SinkProgress(self))
        return self.loop

    def _finish_run(self, message: str) -> None:
        loop, run = self.loop, self.run
        self.closed_reason = message
        if loop is None or run is None:
            return
        run.status, run.message, run.finished_at = "done", message, time.time()
        run.options["elapsed_s"] = run.options.get("elapsed_s", 0.0) + time.monotonic() - loop.started
        table = loop.state().gates
        run.gates_after = list(table)
        self.ledger.save_run(run)

    def _submit(self, step: Step) -> None:
        self._submitted = step

    # ------------------------------------------------------------ tools

    def _tools(self) -> list[Tool]:
        registry_tools = {t.name: t for t in (*code_tools.TOOLS, *exp_tools.TOOLS)}
        run_tool = registry_tools["run_experiment"]
        tools = [t for t in registry_tools.values() if t.name != "run_experiment"]
        tools.insert(len(code_tools.TOOLS) + 1, Tool(
            "run_experiment", run_tool.description + " The change may be given inline (knobs, diff) or built first with "
            "set_knobs and propose_diff. It runs through the planner, the executor (git worktree for a diff, protected "
            "paths), the judge and the ledger, against the current best; the first call measures the baseline.",
            McpRunExperimentArgs, self._run_experiment))
        return [
            Tool("validate_workspace", "Load and validate the workspace (infra-agent.yaml) as it is on disk now; list its "
                 "target, knobs (domains, components), scenarios, criteria, checks and protected paths.",
                 NoArgs, self._validate_workspace),
            Tool("list_knobs", "List the knobs: type and domain, default, the value the current best runs with, the "
                 "components each affects.", NoArgs, self._list_knobs),
            Tool("run_probe", "Run one probe on the workspace (its code as it is, with the given knob values) in a "
                 "worker subprocess with a timeout, and return its Feedback (measurements, findings). Nothing is "
                 "judged or recorded in the ledger.", RunProbeArgs, self._run_probe),
            *tools,
            Tool("list_runs", "List the runs in the workspace's ledger, newest first.", NoArgs, self._list_runs),
            Tool("list_experiments", "List a run's experiments from the ledger: hypothesis, change, verdict, cost.",
                 ListExperimentsArgs, self._list_experiments),
            Tool("read_findings", "Read one experiment's findings from the ledger (kind, severity, location, evidence, "
                 "the next question to ask).", ReadFindingsArgs, self._read_findings),
        ]

    def _validate_workspace(self, ctx: ToolContext, args: NoArgs) -> ToolResult:
        from infra_agent.probes.base import get_probe
        from infra_agent.workspace import load_workspace

        where = self.ws.source or self.ws.root
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
            "target": _target_summary(ws),
            "knobs": _knob_rows(ws, values),
            "scenarios": {n: _scenario_summary(s) for n, s in ws.scenarios.items()},
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
        if ws.model_dump() != self.ws.model_dump():
            lines.append("note: the file changed since this session loaded it; the session keeps the workspace it loaded")
        return ToolResult(text="\n".join(lines), data=data, error=bool(problems))

    def _best_knobs(self) -> dict[str, Any]:
        if self.loop is not None:
            return dict(self.loop.state().best.knobs)
        try:
            return dict(self.ws.resolve_knobs())
        except InfraAgentError:
            return {}

    def _list_knobs(self, ctx: ToolContext, args: NoArgs) -> ToolResult:
        rows = _knob_rows(self.ws, self._best_knobs())
        lines = [f"{len(rows)} knob(s)" + (f"; values are the current best's ({self.loop.state().best.id})"
                                           if self.loop is not None else "; values are the defaults")]
        for k in rows:
            lines.append(f"- {k['name']} = {k['value']!r}: {k['domain']} (default {k['default']!r}); components "
                         f"{', '.join(k['components']) or '-'}" + (f"; {k['help']}" if k["help"] else ""))
        return ToolResult(text="\n".join(lines), data={"knobs": rows})

    def _run_probe(self, ctx: ToolContext, args: RunProbeArgs) -> ToolResult:
        from infra_agent.agent.executors.jobs import ProbeTimeout, run_job
        from infra_agent.errors import ConfigError
        from infra_agent.feedback import Feedback
        from infra_agent.probes.base import get_probe
        from infra_agent.safety import bound

        if (refused := self._budget_refusal("run_probe", experiment=False)) is not None:
            return refused
        try:
            knobs = self.ws.resolve_knobs({**self._best_knobs(), **args.knobs})
        except ConfigError as exc:
            return ToolResult.fail(f"run_probe: field 'knobs': {exc}", problem="invalid_arguments")
        check = next((c for c in self.ws.checks if c.name == args.probe), None)
        probe_name = check.probe if check is not None else args.probe
        try:
            cls = get_probe(probe_name)
        except ConfigError as exc:
            return ToolResult.fail(f"run_probe: field 'probe': expected a probe ('serving', 'kernel', 'command', a "
                                   f"dotted path) or a workspace check ({', '.join(c.name for c in self.ws.checks) or 'none'}), "
                                   f"got {args.probe!r} ({exc})", problem="invalid_arguments")
        config = {**(check.render(knobs) if check is not None else {}), **args.config}
        try:
            cfg = cls.parse_config(config, where=f"run_probe config of the {cls.name} probe")
        except ConfigError as exc:
            return ToolResult.fail(f"run_probe: {exc}", problem="invalid_config")
        tier = cls.tier(cfg)
        limit = self.opts.probe_timeout_s if tier.value in ("e2e", "trace") else self.opts.check_timeout_s
        timeout = min(args.timeout_s or limit, self.opts.probe_timeout_s)
        self.probes_run += 1
        job_id = f"p{self.probes_run}"
        source = self.ws.source or (self.ws.root / "infra-agent.yaml")
        what = f"probe {cls.name!r} ({tier.value})"
        self.report(f"{what} starts (timeout {timeout:g} s)")
        beat = _Heartbeat(self, what, self.opts.heartbeat_s)
        t0 = time.monotonic()
        try:
            out = run_job(self.ws.root / ".infra-agent" / "mcp" / self.id, self._marker_run, job_id,
                          {"kind": "probe", "probe": probe_name, "config": config, "workspace": str(source),
                           "knobs": knobs}, timeout, lambda ev: self.report(describe_event(ev)), what)
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
                "knobs": knobs, "measurements": [_measurement(m) for m in fb.measurements],
                "findings": [f.model_dump(mode="json", exclude_none=True) for f in fb.findings[:50]]}
        return ToolResult(text=head + "\n" + bound(fb.render_text(), _FEEDBACK_CHARS), data=data, error=not fb.ok)

    def _run_experiment(self, ctx: ToolContext, args: McpRunExperimentArgs) -> ToolResult:
        from infra_agent.agent.proposers.llm_prompt import experiment_result

        if self.closed_reason is not None:
            return ToolResult.fail(f"run_experiment: this session's run is closed ({self.closed_reason}); start a new "
                                   "session to run more experiments", problem="closed")
        if (refused := self._budget_refusal("run_experiment", experiment=True)) is not None:
            return refused
        # The change and the hypothesis are checked before anything is opened or measured.
        if self.loop is not None:
            ctx.state = self.loop.state()
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
        self._submitted = None
        hyp = exp_tools.RunExperimentArgs.model_validate(args.model_dump(exclude={"knobs", "diff"}))
        res = exp_tools.run_experiment(ctx, hyp)
        if res.error or self._submitted is None:
            if args.knobs is not None or args.diff is not None:
                ctx.pending = before
            return res
        loop = self._open_run()
        if not loop.ensure_baseline():
            ctx.pending = self._submitted.change  # kept for the next call
            return ToolResult.fail(f"run_experiment: {self.run.message if self.run else 'the baseline failed'}; the "
                                   "next call measures the baseline again", problem="baseline")
        if not self._restored:
            # As `infra-agent run` does: make the run's branch hold the best's code.
            try:
                loop.executor.restore(loop.state().best)
            except InfraAgentError as exc:
                self.report(f"warning: could not restore the run's branch: {exc}")
            self._restored = True
        step, self._submitted = self._submitted, None
        self.experiments_run += 1
        beat = _Heartbeat(self, "run_experiment", self.opts.heartbeat_s)
        try:
            exp = loop.run_step(step)
        finally:
            beat.close()
        summary = exp_tools.experiment_summary(exp)
        state = loop.state()
        summary["best"] = state.best.id
        summary["run"] = loop.run.id
        summary["gates"] = [g.model_dump(mode="json", exclude_none=True) for g in state.gates]
        text = f"run {loop.run.id}: " + experiment_result(exp, _FEEDBACK_CHARS) + f"\ncurrent best: {state.best.id}"
        # Never ran (screened out, or no probe could answer it): the call failed; a verdict, even a refuted one, did not.
        return ToolResult(text=text, data=summary, error=exp.probe is None and exp.status != "done")

    def _list_runs(self, ctx: ToolContext, args: NoArgs) -> ToolResult:
        runs = self._open_ledger().list_runs()
        rows = [{"id": r.id, "proposer": r.proposer, "status": r.status, "started_at": r.started_at,
                 "baseline": r.baseline, "best": r.best, "message": r.message} for r in runs]
        lines = [f"{len(rows)} run(s) in {self.ledger.path}" + (f"; this session's run is {self.run.id}" if self.run else "")]
        lines += [f"- {r['id']} [{r['proposer']}] {r['status']} best={r['best'] or '-'}" + (f": {r['message']}" if r["message"] else "")
                  for r in rows]
        return ToolResult(text="\n".join(lines), data={"runs": rows})

    def _list_experiments(self, ctx: ToolContext, args: ListExperimentsArgs) -> ToolResult:
        ledger = self._open_ledger()
        run_id = args.run or (self.run.id if self.run else None)
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

    def _read_findings(self, ctx: ToolContext, args: ReadFindingsArgs) -> ToolResult:
        ledger = self._open_ledger()
        run_id = args.run
        if run_id is None and self.run is not None and any(e.id == args.experiment for e in ledger.experiments(self.run.id)):
            run_id = self.run.id
        side = None if args.side == "both" else args.side
        findings = ledger.findings(args.experiment, side=side, run_id=run_id)  # type: ignore[arg-type]
        rows = [f.model_dump(mode="json", exclude_none=True) for f in findings]
        lines = [f"{len(rows)} finding(s) of experiment {args.experiment} ({args.side})"]
        for f in findings:
            where = f" at {f.location}" if f.location is not None and str(f.location) else ""
            lines.append(f"- [{f.severity}] {f.kind}{where}: {f.message}"
                         + (f" | next: {f.next_question}" if f.next_question else ""))
        return ToolResult(text="\n".join(lines), data={"experiment": args.experiment, "run": run_id, "findings": rows})


class _SubmittedStep:
    """The loop's proposer in an MCP session: steps come from tool calls, so it never proposes."""

    name = PROPOSER

    def propose(self, state: Any) -> Step | None:
        return None

    def observe(self, state: Any, experiment: Experiment) -> None:
        return None


# ---------------------------------------------------------------- rendering helpers


def _knob_rows(ws: Any, values: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"name": n, "type": k.type, "domain": k.domain(), "default": k.default, "value": values.get(n),
             "components": list(k.components), "help": k.help} for n, k in ws.knobs.items()]


def _target_summary(ws: Any) -> str:
    t = ws.target
    if getattr(t, "url", None) and not getattr(t, "command", None):
        return f"endpoint {t.url}"
    command = t.command if isinstance(t.command, str) else " ".join(t.command)
    return f"server: {command}"


def _scenario_summary(sc: Any) -> str:
    ds = sc.dataset
    data = f"{ds.kind}" + (f" in={ds.input_len}" if hasattr(ds, "input_len") else "") + \
           (f" out={ds.output_len}" if hasattr(ds, "output_len") else "")
    return f"{data}, {sc.num_requests} requests, concurrency {sc.max_concurrency or '-'}, endpoint {sc.endpoint}"


def _measurement(m: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"name": m.name, "unit": m.unit, "value": m.summary.median if m.summary else None}
    if m.tags:
        row["tags"] = dict(m.tags)
    if m.summary is not None:
        row["n"] = m.summary.n
    return row
