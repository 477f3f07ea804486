"""The registry: schemas from the pydantic models, and bad calls that come back as error results."""

from __future__ import annotations

import json

import pytest

from infra_agent.tools import (
    Tool,
    ToolArgs,
    ToolContext,
    ToolRegistry,
    ToolResult,
    default_registry,
)

NAMES = ["read_file", "search_code", "propose_diff", "set_knobs", "run_experiment", "read_ledger", "finish"]


def test_openai_tools_are_generated_from_the_models() -> None:
    tools = default_registry().openai_tools()
    assert [t["function"]["name"] for t in tools] == NAMES
    for t in tools:
        assert t["type"] == "function"
        params = t["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert t["function"]["description"]
        assert "$ref" not in json.dumps(params) and "$defs" not in json.dumps(params)
    run = next(t for t in tools if t["function"]["name"] == "run_experiment")["function"]["parameters"]
    assert set(run["required"]) == {"statement", "metric", "direction"}
    assert run["properties"]["direction"]["enum"] == ["higher", "lower"]
    assert "component" in run["properties"]["locality"]["properties"]


def test_specs_are_neutral() -> None:
    specs = default_registry().specs()
    assert [s["name"] for s in specs] == NAMES
    assert all(set(s) == {"name", "description", "input_schema"} for s in specs)


def test_unknown_tool_names_the_tool_and_lists_the_tools(ctx: ToolContext, registry: ToolRegistry) -> None:
    r = registry.call("rm_rf", "{}", ctx)
    assert r.error and "unknown tool 'rm_rf'" in r.text and "read_file" in r.text


def test_arguments_that_are_not_json(ctx: ToolContext, registry: ToolRegistry) -> None:
    r = registry.call("read_file", '{"path": "src/engine.py"', ctx)
    assert r.error
    assert r.text.startswith("read_file: the arguments are not valid JSON")
    assert "path, start_line, max_lines" in r.text and '{"path": "src/engine.py"' in r.text


def test_arguments_that_are_not_an_object(ctx: ToolContext, registry: ToolRegistry) -> None:
    r = registry.call("read_file", '["src/engine.py"]', ctx)
    assert r.error and "JSON object" in r.text and "list" in r.text


@pytest.mark.parametrize(("args", "expect"), [
    ({}, "field 'path': expected a value (it is required), got nothing"),
    ({"path": "a", "start_line": "abc"}, "field 'start_line': expected a valid integer"),
    ({"path": "a", "max_lines": 0}, "field 'max_lines': expected greater than or equal to 1, got 0"),
    ({"path": "a", "colour": "red"}, "field 'colour': not a field of this tool"),
])
def test_validation_errors_name_field_expected_and_got(ctx: ToolContext, registry: ToolRegistry, args: dict,
                                                       expect: str) -> None:
    r = registry.call("read_file", json.dumps(args), ctx)
    assert r.error and r.text.startswith("read_file: invalid arguments")
    assert expect in r.text


def test_empty_arguments_are_an_empty_object(ctx: ToolContext, registry: ToolRegistry) -> None:
    r = registry.call("read_ledger", "", ctx)
    assert not r.error and "e0" in r.text


def test_a_tool_that_raises_becomes_an_error_result(ctx: ToolContext) -> None:
    class NoArgs(ToolArgs):
        pass

    def boom(ctx: ToolContext, args: NoArgs) -> ToolResult:
        raise RuntimeError("kaput")

    reg = ToolRegistry([Tool("boom", "raises", NoArgs, boom)])
    r = reg.call("boom", None, ctx)
    assert r.error and "boom failed: RuntimeError: kaput" in r.text


def test_results_are_masked_by_value(ctx: ToolContext, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    # The secrets a result may hold are the known ones: the environment's, the context's (a key given
    # by argument), the target's.  Each is masked wherever it recurs, and a URL's password too.
    monkeypatch.setenv("SERVICE_TOKEN", "tok-9f8e7d6c5b4a")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live-abcdef123456")
    ctx.secrets = ["abcdefghijklmnop"]
    (ctx.code_root / "config.txt").write_text(
        "url=http://x\nOPENAI_API_KEY=sk-live-abcdef123456\nheader Authorization: Bearer abcdefghijklmnop\n"
        "leaked tok-9f8e7d6c5b4a here\ndb = 'postgres://app:hunter2x@db/main'\n")
    r = registry.call("read_file", '{"path": "config.txt"}', ctx)
    assert not r.error
    for secret in ("sk-live-abcdef123456", "abcdefghijklmnop", "tok-9f8e7d6c5b4a", "hunter2x"):
        assert secret not in r.text, secret
    assert "OPENAI_API_KEY=***" in r.text and "postgres://app:***@db/main" in r.text
    s = registry.call("search_code", '{"pattern": "leaked"}', ctx)
    assert "tok-9f8e7d6c5b4a" not in json.dumps(s.data) and "tok-9f8e7d6c5b4a" not in s.text


def test_code_that_names_secrets_comes_through_as_written(ctx: ToolContext, registry: ToolRegistry) -> None:
    # No name or shape of text masks anything in a tool's result: these are code, not secrets.
    code = ('next_token = "tok_0123456789"\npassword = args.password2x\ncache_key=blk_12345678\n'
            'self.key = key1234abcd\nheaders = {"Authorization": f"Bearer {token}"}\n'
            'url = f"postgres://{user}:{password}@{host}/db"\n')
    (ctx.code_root / "client.py").write_text(code)
    r = registry.call("read_file", '{"path": "client.py"}', ctx)
    assert not r.error and "***" not in r.text
    for line in code.splitlines():
        assert line in r.text, line


def test_results_are_bounded(ctx: ToolContext) -> None:
    (ctx.code_root / "long.txt").write_text("".join(f"line {i} " + "y" * 80 + "\n" for i in range(500)))
    reg = default_registry()
    reg.max_result_chars = 1000
    r = reg.call("read_file", '{"path": "long.txt", "max_lines": 2000}', ctx)
    assert not r.error and len(r.text) < 1100 and "characters" in r.text and "cut" in r.text
