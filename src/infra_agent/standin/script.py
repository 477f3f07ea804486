"""Scripts for the stand-in chat server: the turns it answers with, and faults to inject.

A script is YAML or JSON: either a list of turns, or a mapping with ``turns`` and
options::

    model: standin              # the name /v1/models reports
    require_key: "sk-test"      # answer 401 unless the request's bearer key is this
    fail: {status: 429, times: 2}   # the first 2 requests get HTTP 429
    delay_s: 0                  # wait this long before every answer
    on_exhausted: finish        # after the last turn: a `finish` tool call (or `text`)
    turns:
      - tool_calls:
          - {tool: read_file, arguments: {path: src/engine.py}}
          - {tool: set_knobs, arguments_text: '{"knobs": '}   # malformed on purpose
      - text: "I have nothing to add."
      - delay_s: 5                # this turn answers after 5 s (client timeouts)
        fail: {status: 500, times: 1}
        when_tool_result_contains: "verdict: SUPPORTED"   # used only if the latest tool
        tool_calls: [...]                                 # results contain it, else skipped

``ScriptPlayer`` plays a script against incoming chat requests, deterministically,
and records every request it received.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra_agent.errors import ConfigError

CHARS_PER_TOKEN = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallSpec(_Strict):
    tool: str = Field(min_length=1)
    arguments: dict[str, Any] | None = None  # sent as JSON text
    arguments_text: str | None = None  # sent verbatim (malformed JSON on purpose)

    @model_validator(mode="after")
    def _one_form(self) -> ToolCallSpec:
        if self.arguments is not None and self.arguments_text is not None:
            raise ValueError("expected one of `arguments` (a mapping) or `arguments_text` (raw text), got both")
        return self

    def text(self) -> str:
        if self.arguments_text is not None:
            return self.arguments_text
        return json.dumps(self.arguments or {})


class Fault(_Strict):
    status: int = Field(ge=400, le=599, description="the HTTP status to answer with")
    times: int = Field(1, ge=1, description="how many requests get it")
    message: str = ""


class Turn(_Strict):
    tool_calls: list[ToolCallSpec] | None = None
    text: str | None = None
    fail: Fault | None = None
    delay_s: float = Field(0.0, ge=0)
    when_tool_result_contains: str | None = None

    @model_validator(mode="after")
    def _one_answer(self) -> Turn:
        if (self.tool_calls is None) == (self.text is None):
            got = "both" if self.text is not None else "neither"
            raise ValueError(f"expected a turn with exactly one of `tool_calls` or `text`, got {got}")
        if self.tool_calls is not None and not self.tool_calls:
            raise ValueError("expected at least one tool call in `tool_calls`, got an empty list")
        return self


class Script(_Strict):
    model: str = "standin"
    require_key: str | None = None
    fail: Fault | None = None
    delay_s: float = Field(0.0, ge=0)
    on_exhausted: Literal["finish", "text"] = "finish"
    turns: list[Turn] = Field(default_factory=list)


def parse_script(data: Any, source: str = "<script>") -> Script:
    """A script from parsed YAML/JSON (a list of turns, or a mapping); ``ConfigError`` names the field."""
    if isinstance(data, Script):
        return data
    if isinstance(data, list):
        data = {"turns": data}
    if not isinstance(data, Mapping):
        got: Any = "an empty file" if data is None else data
        raise ConfigError(source, None, "a list of turns, or a mapping with `turns:` (a list) and options", got)
    try:
        return Script.model_validate(dict(data))
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc) or None
        expected = str(err["msg"]).removeprefix("Value error, ").removeprefix("Input should be ").replace("a valid ", "a ")
        if err["type"] == "missing":
            expected, got = "a value (required)", None
        elif err["type"] == "extra_forbidden":
            model = _model_at(err["loc"])
            keys = ", ".join(model.model_fields) if model is not None else ""
            expected = f"one of the keys {keys}" if keys else "only the documented keys"
            got = loc[-1] if loc else field
        else:
            got = err.get("input")
        if expected.startswith("expected ") and ", got " in expected:
            expected, got = expected.removeprefix("expected ").split(", got ", 1)
        raise ConfigError(source, field, expected, got) from None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that holds the last key of ``loc`` (for an unknown key: which keys it knows)."""
    model: type[BaseModel] | None = Script
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        inner = field.annotation
        model = next((t for t in (inner, *getattr(inner, "__args__", ())) if isinstance(t, type) and issubclass(t, BaseModel)),
                     None)
        if model is None:  # list[Turn] | None: one level further down
            for arg in getattr(inner, "__args__", ()):
                model = next((t for t in getattr(arg, "__args__", ()) if isinstance(t, type) and issubclass(t, BaseModel)),
                             model)
    return model


def load_script(path: str | Path) -> Script:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), None, "a script file (YAML or JSON)", "no such file") from None
    except IsADirectoryError:
        raise ConfigError(str(p), None, "a script file (YAML or JSON)", "a directory") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(str(p), None, "a readable script file (YAML or JSON, UTF-8)", reason) from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = "; ".join(x for x in (exc.context, exc.problem) if x) or str(exc).splitlines()[0]
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(p), None, "valid YAML or JSON", at + problem) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), None, "valid YAML or JSON", str(exc).splitlines()[0]) from None
    return parse_script(data, str(p))


def estimate_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


class Answer:
    """What the server sends: a status, a JSON body, after a delay."""

    def __init__(self, status: int, body: dict[str, Any], delay_s: float = 0.0) -> None:
        self.status = status
        self.body = body
        self.delay_s = delay_s


def _error(status: int, message: str) -> dict[str, Any]:
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "server_error" if status >= 500 else
                                                                      "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": status}}


def _latest_tool_results(messages: list[Any]) -> str:
    """The tool messages after the last assistant message, joined."""
    out: list[str] = []
    for m in reversed(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            break
        if m.get("role") == "tool":
            content = m.get("content")
            out.append(content if isinstance(content, str) else json.dumps(content))
    return "\n".join(reversed(out))


class ScriptPlayer:
    """Answers chat requests from a script; thread-safe; records what it received."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self._lock = threading.Lock()
        self._cursor = 0
        self._global_fail_left = script.fail.times if script.fail else 0
        self._turn_fail_left = [t.fail.times if t.fail else 0 for t in script.turns]
        self._answers = 0
        self.requests: list[dict[str, Any]] = []

    @property
    def cursor(self) -> int:
        return self._cursor

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.script.model, "object": "model", "owned_by": "infra-agent"}]}

    def answer(self, body: Any, authorization: str | None) -> Answer:
        with self._lock:
            record: dict[str, Any] = {"n": len(self.requests), "time": time.time(),
                                      "authorization": "present" if authorization else "absent"}
            self.requests.append(record)
            ans = self._answer(body, authorization, record)
            record["status"] = ans.status
            return ans

    def _answer(self, body: Any, authorization: str | None, record: dict[str, Any]) -> Answer:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return Answer(400, _error(400, "expected a JSON object with a `messages` list"))
        messages: list[Any] = body["messages"]
        tools = [t.get("function", {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
        record.update(model=body.get("model"), messages=messages, tools=tools)
        if body.get("stream"):
            return Answer(400, _error(400, "the stand-in answers only non-streaming requests; send stream: false"))
        if self.script.require_key is not None:
            key = (authorization or "").removeprefix("Bearer ").removeprefix("bearer ").strip()
            if key != self.script.require_key:
                return Answer(401, _error(401, "invalid API key (the stand-in script requires another key)"))
        if self._global_fail_left > 0:
            self._global_fail_left -= 1
            assert self.script.fail is not None
            return Answer(self.script.fail.status,
                          _error(self.script.fail.status, self.script.fail.message or "injected fault (stand-in script)"))
        latest = _latest_tool_results(messages)
        while self._cursor < len(self.script.turns):
            cond = self.script.turns[self._cursor].when_tool_result_contains
            if cond is None or cond in latest:
                break
            self._cursor += 1  # a conditional turn whose condition does not hold is skipped
        if self._cursor >= len(self.script.turns):
            record["turn"] = None
            return Answer(200, self._completion(body, self._exhausted(tools)), self.script.delay_s)
        idx = self._cursor
        turn = self.script.turns[idx]
        record["turn"] = idx
        if turn.fail is not None and self._turn_fail_left[idx] > 0:
            self._turn_fail_left[idx] -= 1
            return Answer(turn.fail.status, _error(turn.fail.status, turn.fail.message or "injected fault (stand-in script)"))
        self._cursor += 1
        if turn.tool_calls is not None:
            message = self._tool_message([(c.tool, c.text()) for c in turn.tool_calls])
        else:
            message = {"role": "assistant", "content": turn.text}
        return Answer(200, self._completion(body, message), self.script.delay_s + turn.delay_s)

    def _exhausted(self, tools: list[Any]) -> dict[str, Any]:
        reason = "the stand-in script has no more turns"
        if self.script.on_exhausted == "finish" and "finish" in tools:
            return self._tool_message([("finish", json.dumps({"reason": reason}))])
        return {"role": "assistant", "content": f"({reason})"}

    def _tool_message(self, calls: list[tuple[str, str]]) -> dict[str, Any]:
        n = self._answers
        return {"role": "assistant", "content": None,
                "tool_calls": [{"id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                               for i, (name, args) in enumerate(calls)]}

    def _completion(self, body: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
        self._answers += 1
        prompt = estimate_tokens(json.dumps(body.get("messages"), default=str) + json.dumps(body.get("tools") or [], default=str))
        completion = max(1, estimate_tokens(json.dumps(message)))
        return {
            "id": f"chatcmpl-standin-{self._answers}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.script.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
