"""The MCP binding: an ``McpSession``'s tools served with the ``mcp`` package, over stdio or HTTP.

The low-level ``mcp`` server is used (not its decorator-built tools), so each tool's
input schema is the registry's own JSON schema, and arguments are validated once, by
the registry, with its field/expected/got messages.  A tool call runs in a worker
thread (the session serialises calls); every result, an error included, is a
``CallToolResult`` (``isError`` set for a refused or failed call), so a bad call never
ends the session.  What a probe or experiment reports while it runs (the worker's JSON
events, a heartbeat) goes to the client as ``notifications/progress`` when the call
carried a progress token.

Both major versions of the ``mcp`` package are served: 2.x registers handlers in the
``Server`` constructor, 1.x through its decorators.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from mcp import types
from mcp.server.lowlevel import Server

from infra_agent import __version__
from infra_agent.mcp.session import McpSession
from infra_agent.safety import mask_values, workspace_secrets
from infra_agent.tools.registry import ToolResult

log = logging.getLogger(__name__)

SERVER_NAME = "infra-agent"
INSTRUCTIONS = (
    "infra-agent: find and fix performance bottlenecks in an LLM inference stack. Start with validate_workspace "
    "and list_knobs; run_probe measures without judging (the workspace, or an experiment's code); run_experiment "
    "tests ONE hypothesis (metric, direction, minimum effect) with knobs and/or a diff against the current best, "
    "records the verdict in the ledger and returns both sides' metrics and findings; analyze_trace and diff_traces "
    "read a probe's saved traces again; read_ledger, list_experiments and read_findings read what was measured.")

_MODERN = "on_call_tool" in inspect.signature(Server.__init__).parameters  # mcp >= 2


def _tools(session: McpSession) -> list[types.Tool]:
    return [types.Tool(name=s["name"], description=s["description"], inputSchema=s["input_schema"])
            for s in session.specs()]


def _result(res: ToolResult, secrets: list[str]) -> types.CallToolResult:
    """The call's result for the client; masked again by value, as everything leaving the server is
    (the registry masked it already: this covers data that ``default=str`` turns into text)."""
    structured = mask_values(json.loads(json.dumps(res.data, default=str)), secrets) if res.data else None
    return types.CallToolResult(content=[types.TextContent(type="text", text=mask_values(res.text, secrets))],
                                isError=res.error, structuredContent=structured)


async def _call(session: McpSession, name: str, arguments: Any, send_progress: Any) -> types.CallToolResult:
    """Run the call in a worker thread; its progress lines go back through ``send_progress`` (async)."""
    # Progress comes from the call's thread, the worker's event reader and the heartbeat.
    loop_token = anyio.lowlevel.current_token()
    lock = threading.Lock()
    count = 0
    secrets = workspace_secrets(session.ws)

    def progress(message: str) -> None:
        nonlocal count
        with lock:
            count += 1
            n = count
        anyio.from_thread.run(send_progress, float(n), mask_values(message, secrets), token=loop_token)

    res = await anyio.to_thread.run_sync(functools.partial(session.call, name, arguments, progress if send_progress else None),
                                         abandon_on_cancel=True)
    return _result(res, secrets)


def _progress_token(meta: Any) -> Any:
    """The request's progress token, if the client asked for progress (a dict in mcp 2, a model in 1)."""
    if meta is None:
        return None
    if isinstance(meta, dict):
        return meta.get("progress_token", meta.get("progressToken"))
    return getattr(meta, "progress_token", None) or getattr(meta, "progressToken", None)


def build_server(session: McpSession) -> Any:
    """A low-level ``mcp`` server whose tools are the session's."""
    if _MODERN:
        async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
            return types.ListToolsResult(tools=_tools(session))

        async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
            token = _progress_token(getattr(params, "meta", None) or getattr(ctx, "meta", None))

            async def send(progress: float, message: str) -> None:
                await ctx.session.report_progress(progress, None, message)

            return await _call(session, params.name, params.arguments, send if token is not None else None)

        return Server(SERVER_NAME, version=__version__, instructions=INSTRUCTIONS, on_list_tools=list_tools,
                      on_call_tool=call_tool)

    # mcp 1.x
    server = Server(SERVER_NAME, version=__version__, instructions=INSTRUCTIONS)  # type: ignore[call-arg]

    @server.list_tools()  # type: ignore[attr-defined,misc]
    async def _list() -> list[types.Tool]:
        return _tools(session)

    kwargs = {"validate_input": False} if "validate_input" in inspect.signature(server.call_tool).parameters else {}  # type: ignore[attr-defined]

    @server.call_tool(**kwargs)  # type: ignore[attr-defined,misc]
    async def _call_v1(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        ctx = server.request_context  # type: ignore[attr-defined]
        token = _progress_token(ctx.meta)

        async def send(progress: float, message: str) -> None:
            try:
                await ctx.session.send_progress_notification(token, progress, None, message=message,
                                                             related_request_id=str(ctx.request_id))
            except TypeError:  # versions without a message field
                await ctx.session.send_progress_notification(token, progress, None)

        return await _call(session, name, arguments, send if token is not None else None)

    return server


async def serve_stdio(session: McpSession) -> None:
    from mcp.server.stdio import stdio_server

    server = build_server(session)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(session: McpSession, host: str = "127.0.0.1", port: int = 8765, path: str = "/mcp") -> None:
    """Streamable HTTP at ``http://HOST:PORT/mcp``."""
    import uvicorn

    server = build_server(session)
    if _MODERN:
        app = server.streamable_http_app(streamable_http_path=path, host=host)
    else:  # mcp 1.x
        from contextlib import asynccontextmanager

        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from starlette.applications import Starlette
        from starlette.routing import Mount

        manager = StreamableHTTPSessionManager(app=server)

        @asynccontextmanager
        async def lifespan(app: Any) -> Any:
            async with manager.run():
                yield

        app = Starlette(routes=[Mount(path, app=manager.handle_request)], lifespan=lifespan)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    await uvicorn.Server(config).serve()


def run(session: McpSession, transport: str = "stdio", host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve until the client goes (stdio: end of input) or the process is stopped."""
    if transport == "stdio":
        anyio.run(serve_stdio, session)
    else:
        anyio.run(functools.partial(serve_http, session, host, port))
