"""The arguments of the MCP session's own tools, as the registry validates them.

Each model is what a client may send to one tool (named fields, their bounds, and the
description the client reads in the tool's schema); an unknown field is refused by
``ToolArgs``.  They are apart from the session because the tools that take them live in
three modules (the session, :mod:`infra_agent.mcp.views`,
:mod:`infra_agent.mcp.probe_tool`) and none of them owns the schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

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


__all__ = ["ListExperimentsArgs", "McpRunExperimentArgs", "NoArgs", "ReadFindingsArgs", "RunProbeArgs"]
