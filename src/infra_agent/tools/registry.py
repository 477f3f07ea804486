"""The tool registry: typed tools, their JSON schemas, and calls that never raise.

A ``Tool`` is a name, a description, a pydantic arguments model (unknown fields
forbidden) and a function ``(ctx, args) -> ToolResult``.  ``ToolRegistry.specs()``
describes the tools neutrally (name, description, JSON schema of the arguments), so
the same registry serves the ``llm`` proposer (``openai_tools()`` is one rendering)
and an MCP server.

``ToolRegistry.call`` takes the arguments as the model sent them (JSON text, a
mapping or nothing).  Whatever goes wrong (an unknown tool, text that is not JSON,
a field that fails validation, a tool that raises) comes back as a ``ToolResult``
with ``error=True`` whose text names the tool, the field, what was expected and
what came, so the conversation can go on.  Every result is bounded, and masked of
secrets by value (``safety.mask_values``: the known secrets and URL passwords, never
a name in code or a metric's name), before anyone sees it: what a target prints is
data, never trusted.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from infra_agent.errors import InfraAgentError
from infra_agent.records import Change, LoopState, Step
from infra_agent.safety import bound, mask_values, secret_values, target_secrets

log = logging.getLogger(__name__)

# What one tool result may put into a conversation.
DEFAULT_RESULT_CHARS = 12_000
_GOT_CHARS = 120


class ToolArgs(BaseModel):
    """Base of every tool's arguments: unknown fields are an error, not ignored."""

    model_config = ConfigDict(extra="forbid")


class ToolResult(BaseModel):
    """``text`` is for the model; ``data`` is the same content for machines."""

    model_config = ConfigDict(extra="forbid")

    text: str
    data: dict[str, Any] = Field(default_factory=dict)
    error: bool = False

    @classmethod
    def fail(cls, text: str, **data: Any) -> ToolResult:
        return cls(text=text, data=data, error=True)


@dataclass
class ToolContext:
    """What the tools act on; one per conversation, kept between calls.

    ``code_root`` is the tree the file tools are confined to.  ``pending`` collects
    ``set_knobs`` and ``propose_diff`` until ``run_experiment`` turns it into a
    ``Step`` and hands it to ``submit_step``.  ``protected`` holds glob patterns of
    paths a diff may not touch (file tools may still read them).
    """

    code_root: Path
    workspace: Any = None  # infra_agent.workspace.Workspace
    state: LoopState | None = None
    pending: Change = field(default_factory=lambda: Change(diff=None))
    submit_step: Callable[[Step], Any] | None = None
    finished: str | None = None
    protected: list[str] = field(default_factory=list)
    # Extra secret values to mask in results (an API key given by argument).
    secrets: list[str] = field(default_factory=list)


ToolFn = Callable[[ToolContext, Any], ToolResult]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    args: type[BaseModel]  # a ToolArgs (or another model that forbids unknown fields)
    fn: ToolFn

    def input_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments, self-contained (no ``$ref``), without titles."""
        return _plain_schema(self.args.model_json_schema())


class ToolRegistry:
    """Tools by name.  ``call`` never raises; see the module docstring."""

    def __init__(self, tools: Iterable[Tool] = (), max_result_chars: int = DEFAULT_RESULT_CHARS) -> None:
        self._tools: dict[str, Tool] = {}
        self.max_result_chars = max_result_chars
        for t in tools:
            self.register(t)

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool

    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def specs(self) -> list[dict[str, Any]]:
        """Neutral descriptions: ``{name, description, input_schema}`` per tool."""
        return [{"name": t.name, "description": t.description, "input_schema": t.input_schema()}
                for t in self._tools.values()]

    def openai_tools(self) -> list[dict[str, Any]]:
        """The ``tools=`` list of an OpenAI chat completions request."""
        return [{"type": "function",
                 "function": {"name": s["name"], "description": s["description"], "parameters": s["input_schema"]}}
                for s in self.specs()]

    def call(self, name: str, arguments: str | Mapping[str, Any] | None, ctx: ToolContext) -> ToolResult:
        """Run one call; every failure is an error result, never an exception."""
        result = self._call(name, arguments, ctx)
        return self._finish(result, ctx)

    # ------------------------------------------------------------------ internals

    def _call(self, name: str, arguments: str | Mapping[str, Any] | None, ctx: ToolContext) -> ToolResult:
        tool = self._tools.get(name)
        if tool is None:
            return ToolResult.fail(f"unknown tool {_short(name)}; the tools are: {', '.join(self._tools)}",
                                   tool=name, problem="unknown_tool")
        fields = ", ".join(tool.args.model_fields) or "no fields"
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            raw: Any = {}
        elif isinstance(arguments, str):
            try:
                raw = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return ToolResult.fail(
                    f"{name}: the arguments are not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                    f"expected a JSON object with the fields {fields}; got {_short(arguments)}",
                    tool=name, problem="bad_json")
        else:
            raw = dict(arguments)
        if not isinstance(raw, dict):
            return ToolResult.fail(
                f"{name}: expected the arguments as a JSON object with the fields {fields}; "
                f"got a JSON {type(raw).__name__}: {_short(raw)}", tool=name, problem="not_an_object")
        try:
            args = tool.args.model_validate(raw)
        except ValidationError as exc:
            problems = [_explain(err, tool.args) for err in exc.errors(include_url=False)]
            return ToolResult.fail(f"{name}: invalid arguments: " + "; ".join(problems),
                                   tool=name, problem="invalid_arguments", errors=problems)
        try:
            return tool.fn(ctx, args)
        except InfraAgentError as exc:
            return ToolResult.fail(f"{name}: {exc}", tool=name, problem="refused")
        except Exception as exc:  # a tool bug must not end the conversation
            log.exception("tool %s failed", name)
            return ToolResult.fail(f"{name} failed: {type(exc).__name__}: {exc}", tool=name, problem="tool_failed")

    def _finish(self, result: ToolResult, ctx: ToolContext) -> ToolResult:
        values = context_secrets(ctx)
        text = bound(mask_values(result.text, values), self.max_result_chars)
        return ToolResult(text=text, data=mask_values(result.data, values), error=result.error)


def context_secrets(ctx: ToolContext) -> list[str]:
    """What a result must not show: the environment's secrets, ``ctx.secrets``, and the secrets of
    the workspace's target (its env, its command's secret flags, its headers), by value."""
    workspace = ctx.workspace if ctx.workspace is not None else getattr(ctx.state, "workspace", None)
    return secret_values(extra=[*ctx.secrets, *target_secrets(getattr(workspace, "target", None))])


def _short(value: Any) -> str:
    """What came, for an error message: text quoted, other values as JSON, both cut short."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) > _GOT_CHARS:
        text = text[:_GOT_CHARS] + f"... ({len(text)} characters)"
    return repr(text) if isinstance(value, str) else text


def _explain(err: Mapping[str, Any], model: type[BaseModel]) -> str:
    """One pydantic error as ``field 'x': expected ..., got ...``."""
    loc = ".".join(str(p) for p in err.get("loc", ())) or "(arguments)"
    kind = err.get("type", "")
    msg = str(err.get("msg", ""))
    if kind == "missing":
        return f"field {loc!r}: expected a value (it is required), got nothing"
    if kind == "extra_forbidden":
        return f"field {loc!r}: not a field of this tool (expected only {', '.join(model.model_fields)}), got {_short(err.get('input'))}"
    expected = msg
    for prefix in ("Input should be ", "Value error, ", "Assertion failed, "):
        expected = expected.removeprefix(prefix)
    if expected.startswith("expected "):
        expected = expected.removeprefix("expected ")
        if ", got " in expected:  # our own validators already say what came
            expected = expected.split(", got ", 1)[0]
    return f"field {loc!r}: expected {expected}, got {_short(err.get('input'))}"


def _plain_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Inline ``$defs`` references and drop ``title`` keys: smaller, and any client reads it."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                ref = node["$ref"].rsplit("/", 1)[-1]
                merged = {**defs[ref], **{k: v for k, v in node.items() if k != "$ref"}}
                return walk(merged)
            out: dict[str, Any] = {}
            for k, v in node.items():
                if k in ("$defs", "title"):
                    continue
                # Under "properties" the keys are field names (a field may be called "title").
                out[k] = {name: walk(sub) for name, sub in v.items()} if k == "properties" else walk(v)
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    out = walk(schema)
    out.setdefault("properties", {})
    return out
