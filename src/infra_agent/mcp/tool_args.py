"""The arguments of the MCP session's own tools, as the registry validates them.

Each model is what a client may send to one tool (named fields, their bounds, and the
description the client reads in the tool's schema); an unknown field is refused by
``ToolArgs``.  They are apart from the session because the tools that take them live in
several modules (the session, :mod:`infra_agent.mcp.views`, :mod:`infra_agent.mcp.probe_tool`,
:mod:`infra_agent.mcp.experiment_tool`, :mod:`infra_agent.mcp.trace_tool`) and none of them
owns the schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from infra_agent.tools import experiment as exp_tools
from infra_agent.tools.registry import ToolArgs


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
    experiment: str | None = Field(None, min_length=1, description="run the probe on this experiment's code (its "
                                   "accepted commit; else its parent's commit with its diff) and knob values, in a git "
                                   "worktree of its own; default: the workspace as it is, with the current best's knobs")
    run: str | None = Field(None, min_length=1, description="the experiment's run (default: this session's run, else "
                                                            "the run that holds it)")


class McpRunExperimentArgs(exp_tools.RunExperimentArgs):
    """The registry's run_experiment (one hypothesis) with the change inline."""

    knobs: dict[str, bool | int | float | str | None] | None = Field(
        None, description="knob values to test (as set_knobs: checked against each knob's domain; merged into the "
                          "pending change)")
    diff: str | None = Field(None, description="a unified diff in git format to test (as propose_diff: checked with "
                                               "git apply --check and the protected paths)")


class TraceSource(ToolArgs):
    """Where the traces are: a run_probe call of this session, an experiment's side, or files."""

    probe_call: str | None = Field(None, min_length=1, description="a run_probe call of this session, as its result "
                                                                   "names it (p1, p2, ...)")
    experiment: str | None = Field(None, min_length=1, description="an experiment of the ledger (e.g. e3)")
    run: str | None = Field(None, min_length=1, description="the experiment's run (default: this session's run, else "
                                                            "the run that holds it)")
    side: Literal["candidate", "baseline"] = Field("candidate", description="which side of the experiment")
    paths: list[str] = Field(default_factory=list, description="trace files relative to the workspace folder (span "
                             "traces, py-spy dumps or records, Kineto traces), instead of a probe call or experiment")
    scenario: str | None = Field(None, min_length=1, description="which traced window, when the source traced several "
                                                                 "scenarios (default: the first)")

    @model_validator(mode="after")
    def _one_source(self) -> TraceSource:
        given = [n for n in ("probe_call", "experiment", "paths") if getattr(self, n)]
        if len(given) != 1:
            raise ValueError("expected exactly one of probe_call, experiment or paths, got "
                             + (", ".join(given) if given else "none"))
        return self


class AnalyzeTraceArgs(TraceSource):
    by: Literal["cat", "name"] = Field("cat", description="group spans by category or by name")
    expect_overlap: list[str] = Field(default_factory=list, description="'A:B' span groups (names or categories, "
                                                                        "'|' joins several) that should overlap")


class DiffTracesArgs(ToolArgs):
    experiment: str | None = Field(None, min_length=1, description="an experiment: its baseline side against its "
                                                                   "candidate side")
    run: str | None = Field(None, min_length=1, description="the experiment's run (default: this session's, else the "
                                                            "run that holds it)")
    baseline: TraceSource | None = Field(None, description="the reference side (A), instead of an experiment")
    candidate: TraceSource | None = Field(None, description="the side compared with it (B), instead of an experiment")
    scenario: str | None = Field(None, min_length=1, description="which traced window, with experiment")
    per: str | None = Field(None, min_length=1, description="compare per occurrence of this span (e.g. engine.step) "
                                                            "instead of over the whole window")

    @model_validator(mode="after")
    def _sides(self) -> DiffTracesArgs:
        pair = self.baseline is not None and self.candidate is not None
        half = (self.baseline is None) != (self.candidate is None)
        if half or (self.experiment is not None) == pair:
            raise ValueError("expected experiment, or both baseline and candidate (each a probe_call, an experiment "
                             "side or paths)")
        return self


class ListExperimentsArgs(ToolArgs):
    run: str | None = Field(None, description="a run id (default: this session's run, else the newest run)")
    last_n: int = Field(20, ge=1, le=500, description="how many of the latest experiments to list")


class ReadFindingsArgs(ToolArgs):
    experiment: str = Field(min_length=1, description="an experiment id, e.g. e1")
    run: str | None = Field(None, description="its run id (default: this session's run, else the run that holds it)")
    side: Literal["candidate", "baseline", "both"] = Field("candidate", description="which side's findings")


__all__ = ["AnalyzeTraceArgs", "DiffTracesArgs", "ListExperimentsArgs", "McpRunExperimentArgs", "NoArgs", "ReadFindingsArgs",
           "RunProbeArgs", "TraceSource"]
