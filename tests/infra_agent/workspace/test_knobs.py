"""Knob domains: parsing --set text by type, checking values, resolve_knobs errors."""

from __future__ import annotations

import pytest

from infra_agent.errors import ConfigError
from infra_agent.workspace import DomainError, Knob, load_workspace, parse_assignments


@pytest.mark.parametrize(
    ("knob", "text", "value"),
    [
        (Knob(type="int", min=1, max=8), "8", 8),
        (Knob(type="float", min=0), "0.25", 0.25),
        (Knob(type="float"), "3", 3.0),
        (Knob(type="bool"), "Yes", True),
        (Knob(type="bool"), "off", False),
        (Knob(type="choice", choices=["fp32", "bf16"]), "bf16", "bf16"),
        (Knob(type="choice", choices=[1, 2, 4]), "4", 4),  # numeric choices from YAML
        (Knob(type="str"), "a b", "a b"),
    ],
)
def test_parse_by_type(knob: Knob, text: str, value: object) -> None:
    parsed = knob.parse(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize(
    ("knob", "text", "domain"),
    [
        (Knob(type="int", min=1, max=8), "9", "int in [1, 8]"),
        (Knob(type="int", min=1), "0", "int >= 1"),
        (Knob(type="int"), "1.5", "int"),
        (Knob(type="float", max=1), "2", "float <= 1"),
        (Knob(type="float"), "nan", "float"),
        (Knob(type="bool"), "maybe", "bool (true/false)"),
        (Knob(type="choice", choices=["a", "b"]), "c", "one of 'a', 'b'"),
    ],
)
def test_parse_rejects_values_outside_the_domain(knob: Knob, text: str, domain: str) -> None:
    with pytest.raises(DomainError) as info:
        knob.parse(text)
    assert info.value.expected == domain and info.value.got == text


def test_check_keeps_bool_out_of_int_knobs() -> None:
    with pytest.raises(DomainError):
        Knob(type="int").check(True)
    with pytest.raises(DomainError):
        Knob(type="choice", choices=[1, 2]).check(True)


def test_resolve_knobs_overlays_parsed_overrides_on_defaults(write_ws, good: str) -> None:
    ws = load_workspace(write_ws(good))
    values = ws.resolve_knobs({"max_running": "64", "trace": "true", "delay": 1})
    assert values == {"max_running": 64, "precision": "fp32", "root_dir": ".", "delay": 1.0, "trace": True}
    assert ws.resolve_knobs() == {"max_running": 16, "precision": "fp32", "root_dir": ".", "delay": 0.0, "trace": False}


def test_resolve_knobs_value_outside_domain(write_ws, good: str) -> None:
    file = write_ws(good)
    ws = load_workspace(file)
    with pytest.raises(ConfigError) as info:
        ws.resolve_knobs({"max_running": "0"})
    err = info.value
    assert (err.file, err.field, err.expected, err.got) == (str(file.resolve()), "knobs.max_running", "int in [1, 256]", "0")


def test_resolve_knobs_unknown_knob_lists_the_known_ones(write_ws, good: str) -> None:
    file = write_ws(good)
    ws = load_workspace(file)
    with pytest.raises(ConfigError) as info:
        ws.resolve_knobs({"max_runing": "4"})
    err = info.value
    assert err.got == "max_runing"
    assert "delay, max_running, precision, root_dir, trace" in err.expected
    assert str(file.resolve()) in str(err)


def test_parse_assignments() -> None:
    assert parse_assignments(["a=1", "b = x=y", "c="]) == {"a": "1", "b": " x=y", "c": ""}
    with pytest.raises(ConfigError, match="expected name=value"):
        parse_assignments(["novalue"])


def test_knob_without_default_in_launch_command_needs_a_value(tmp_path):
    (tmp_path / "infra-agent.yaml").write_text(
        "target: {kind: server, command: 'srv --port {port} --batch {batch}'}\n"
        "knobs: {batch: {type: int, min: 1, max: 64}}\n"
        "scenarios: {s: {dataset: {kind: random, input_len: 8, output_len: 4}, num_requests: 2}}\n"
    )
    ws = load_workspace(tmp_path)
    with pytest.raises(ConfigError, match=r"knobs\.batch.*pass --set batch="):
        ws.resolve_knobs()
    assert ws.resolve_knobs({"batch": "8"})["batch"] == 8
