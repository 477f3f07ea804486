"""The tool registry: one typed function per tool, used by the ``llm`` proposer and by MCP.

``default_registry()`` holds the standard tools:

- ``read_file``, ``search_code``: read the code root (paths confined, output bounded);
- ``propose_diff``: set the pending code change (checked with ``git apply --check``);
- ``set_knobs``: set pending knob values (checked against the workspace's domains);
- ``run_experiment``: one hypothesis + the pending change -> a ``Step`` for the loop;
- ``read_ledger``: this run's experiments so far;
- ``finish``: stop, with a reason.
"""

from __future__ import annotations

from infra_agent.tools.registry import (
    Tool,
    ToolArgs,
    ToolContext,
    ToolRegistry,
    ToolResult,
)


def default_registry() -> ToolRegistry:
    """A registry with every standard tool, in the order a model usually needs them."""
    from infra_agent.tools import code, experiment

    return ToolRegistry([*code.TOOLS, *experiment.TOOLS])


__all__ = ["Tool", "ToolArgs", "ToolContext", "ToolRegistry", "ToolResult", "default_registry"]
