"""``infra-agent mcp``: the agent loop's tools and the environment's verbs as an MCP server.

- :mod:`infra_agent.mcp.session`: the tools and the session's run, with no MCP code
  (one ``McpSession`` per server process; ``call(name, args, progress)`` never raises);
- :mod:`infra_agent.mcp.views`: its read-only tools (workspace, knobs, ledger runs,
  experiments and findings); :mod:`infra_agent.mcp.probe_tool`: its ``run_probe`` tool,
  on the code :mod:`infra_agent.mcp.probe_code` checks out;
  :mod:`infra_agent.mcp.experiment_tool`: its ``run_experiment`` tool;
  :mod:`infra_agent.mcp.trace_tool`: ``analyze_trace`` and ``diff_traces``;
  :mod:`infra_agent.mcp.tool_args`: its tools' argument models;
  :mod:`infra_agent.mcp.progress`: its progress and heartbeat;
- :mod:`infra_agent.mcp.server`: the binding to the ``mcp`` package (stdio or
  streamable HTTP), tool calls in worker threads, progress as MCP notifications.

See ``docs/mcp.md``.
"""

from __future__ import annotations

__all__ = ["McpOptions", "McpSession"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from infra_agent.mcp import session

        return getattr(session, name)
    raise AttributeError(name)
