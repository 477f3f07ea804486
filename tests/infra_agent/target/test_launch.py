"""Rendering a launch template: argv without a shell unless shell syntax asks for one."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from infra_agent.errors import ConfigError
from infra_agent.target import needs_shell, plan_launch
from infra_agent.workspace import ServerTargetSpec


def spec(command: str | list[str], **kw: object) -> ServerTargetSpec:
    return ServerTargetSpec.model_validate({"kind": "server", "command": command, **kw})


@pytest.mark.parametrize(
    ("command", "shell"),
    [
        ("serve --port {port} --name 'a b'", False),
        ("serve --port {port} | tee log", True),
        ("sleep 1 & exec serve", True),
        ("serve && echo done", True),
        ("serve > out.txt", True),
        ("serve --home $HOME", True),
        ("serve --home ~/x", True),
        ("serve --glob *.txt", True),
    ],
)
def test_needs_shell(command: str, shell: bool) -> None:
    assert needs_shell(command) is shell


def test_string_without_shell_syntax_is_split_into_argv(tmp_path: Path) -> None:
    plan = plan_launch(spec("srv --port {port} --name {name} --flag {on}"), {"name": "a b; rm -rf /", "on": True}, 1234, root=tmp_path, host="127.0.0.1")
    assert not plan.uses_shell
    assert plan.argv == ["srv", "--port", "1234", "--name", "a b; rm -rf /", "--flag", "true"]


def test_shell_string_quotes_every_value(tmp_path: Path) -> None:
    plan = plan_launch(spec("srv --port {port} --name {name} | cat"), {"name": "x; touch pwned"}, 1234, root=tmp_path, host="127.0.0.1")
    assert plan.uses_shell and plan.argv[:2] == ["/bin/sh", "-c"]
    assert shlex.quote("x; touch pwned") in plan.argv[2]
    assert plan.argv[2] == "srv --port 1234 --name 'x; touch pwned' | cat"


def test_list_command_renders_each_element(tmp_path: Path) -> None:
    plan = plan_launch(spec(["srv", "--port={port}", "{name}"], env={"N": "{name}"}, cwd="sub"), {"name": "a b"}, 80, root=tmp_path, host="127.0.0.1")
    assert plan.argv == ["srv", "--port=80", "a b"]
    assert plan.env["N"] == "a b" and plan.env["PYTHONUNBUFFERED"] == "1"
    assert plan.cwd == tmp_path / "sub"


def test_urls_are_paths_or_templates(tmp_path: Path) -> None:
    plan = plan_launch(spec(["srv"], ready_url="/health", metrics_url="http://127.0.0.1:{port}/m"), {}, 99, root=tmp_path, host="127.0.0.1")
    assert plan.ready_url == "http://127.0.0.1:99/health"
    assert plan.metrics_url == "http://127.0.0.1:99/m"


def test_placeholder_without_value_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        plan_launch(spec(["srv", "{threads}"]), {}, 99, root=tmp_path, host="127.0.0.1", file="ws.yaml")
    assert info.value.field == "knobs.threads" and "--set threads=" in info.value.expected
