"""load_workspace: a good file loads; every bad one is a ConfigError naming file, field, expected, got."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from infra_agent.errors import ConfigError
from infra_agent.workspace import (
    EndpointTargetSpec,
    JsonlDataset,
    ServerTargetSpec,
    SharedPrefixDataset,
    load_workspace,
    metric_direction,
)

REPO = Path(__file__).resolve().parents[3]


def test_good_workspace_loads_from_folder_or_file(write_ws, good: str) -> None:
    file = write_ws(good)
    for arg in (file.parent, file, str(file)):
        ws = load_workspace(arg)
        assert ws.source == file.resolve()
        assert ws.root == file.parent.resolve()
    assert isinstance(ws.target, ServerTargetSpec)
    assert ws.target.env == {"OMP_NUM_THREADS": "4"}  # YAML int became text
    assert ws.knobs["max_running"].default == 16
    assert ws.knobs["delay"].default == 0.0 and isinstance(ws.knobs["delay"].default, float)
    assert math.isinf(ws.scenarios["short"].request_rate)
    assert ws.scenarios["short"].burstiness == 1.0 and ws.scenarios["short"].ignore_eos is True
    assert isinstance(ws.scenarios["long"].dataset, SharedPrefixDataset)
    # op defaults from the metric's direction
    assert [c.op for c in ws.criteria] == [">=", "<="]
    assert ws.criteria[0].relative and not ws.criteria[1].relative


def test_example_workspace_validates() -> None:
    ws = load_workspace(REPO / "examples" / "refstack-serving")
    assert isinstance(ws.target, ServerTargetSpec)
    assert {"short-chat", "long-prefill"} <= set(ws.scenarios)
    gate = next(c for c in ws.criteria if c.metric == "total_token_throughput")
    assert (gate.op, gate.ratio, gate.scenario) == (">=", 0.95, "long-prefill")


# (description, edit of GOOD, field path, fragment of expected, got)
BAD_CASES = [
    ("unknown top key", lambda t: t + "colour: red\n", "colour", "one of the keys checks, constraints, criteria, knobs, machine, name, protected, scenarios, target", "colour"),
    ("unknown nested key", lambda t: t.replace("input_len: 128,", "input_len: 128, inptu_len: 3,"),
     "scenarios.short.dataset.inptu_len", "one of the keys input_len, kind, output_len", "inptu_len"),
    ("wrong type", lambda t: t.replace("input_len: 128", "input_len: lots"),
     "scenarios.short.dataset.input_len", "valid integer", "lots"),
    ("out of range", lambda t: t.replace("num_requests: 50", "num_requests: 0"),
     "scenarios.short.num_requests", "a number greater than 0", 0),
    ("missing field", lambda t: t.replace("    num_requests: 10\n", ""),
     "scenarios.long.num_requests", "required", None),
    ("knob default outside domain", lambda t: t.replace("default: 16", "default: 999"),
     "knobs.max_running.default", "int in [1, 256]", 999),
    ("choice default outside domain", lambda t: t.replace("default: fp32", "default: fp8"),
     "knobs.precision.default", "one of 'fp32', 'bf16'", "fp8"),
    ("knob min above max", lambda t: t.replace("min: 1, max: 256", "min: 300, max: 256"),
     "knobs.max_running.max", "max >= min (300)", 256),
    ("unknown placeholder", lambda t: t.replace("{root_dir}", "{rootdir}"),
     "target.command", "placeholders among {port} and the declared knobs", "{rootdir}"),
    ("unknown target kind", lambda t: t.replace("kind: server", "kind: sever"),
     "target.kind", "one of 'server', 'endpoint'", "sever"),
    ("unknown dataset kind", lambda t: t.replace("kind: random", "kind: randm"),
     "scenarios.short.dataset.kind", "'random', 'jsonl', 'shared_prefix'", "randm"),
    ("criterion names a missing scenario", lambda t: t.replace("scenario: long,", "scenario: lng,"),
     "criteria.0.scenario", "one of the scenarios ['long', 'short']", "lng"),
    ("criterion with ratio and value", lambda t: t.replace("ratio: 0.95", "ratio: 0.95, value: 3"),
     "criteria.0", "exactly one of `ratio`", "both"),
    ("criterion on an unknown metric", lambda t: t.replace("metric: total_token_throughput", "metric: zap"),
     "criteria.0.metric", "a metric a benchmark result holds (one of request_throughput", "zap"),
    ("misspelled criterion metric with an op", lambda t: t.replace("metric: total_token_throughput", 'metric: total_token_throughputt, op: ">="'),
     "criteria.0.metric", "did you mean 'total_token_throughput'?", "total_token_throughputt"),
    ("misspelled latency metric", lambda t: t.replace("metric: p99_ttft_ms", "metric: p99_ttf_ms"),
     "criteria.1.metric", "did you mean 'p99_ttft_ms'?", "p99_ttf_ms"),
    ("percentile above 100", lambda t: t.replace("metric: p99_ttft_ms", "metric: p999_ttft_ms"),
     "criteria.1.metric", "a metric a benchmark result holds", "p999_ttft_ms"),
    ("custom metric of unknown direction", lambda t: t.replace("metric: total_token_throughput", "metric: zap, custom: true"),
     "criteria.0.op", "an explicit op", None),
    ("jsonl file missing", lambda t: t.replace("{kind: random, input_len: 128, output_len: 32}", "{kind: jsonl, path: prompts.jsonl, output_len: 8}"),
     "scenarios.short.dataset.path", "an existing file", "prompts.jsonl"),
    ("command of the wrong type", lambda t: t.replace("command: python -m http.server {port} --bind 127.0.0.1 --directory {root_dir}", "command: 7"),
     "target.command", "valid string or a valid list", 7),
]


@pytest.mark.parametrize(("edit", "field", "expected", "got"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_file_field_expected_got(write_ws, good: str, edit, field, expected, got) -> None:
    text = edit(good)
    assert text != good, "the edit must change the file"
    file = write_ws(text)
    with pytest.raises(ConfigError) as info:
        load_workspace(file.parent)
    err = info.value
    assert err.field == field
    assert expected in err.expected
    if got is not None:
        assert err.got == got
    message = str(err)
    assert str(file) in message and field in message and expected in message
    assert "pydantic" not in message and "errors.pydantic.dev" not in message
    # the location points into the file: "path:line:col"
    assert err.file is not None and err.file.startswith(str(file) + ":")


def test_error_points_at_the_line_of_the_field(write_ws, good: str) -> None:
    file = write_ws(good.replace("input_len: 128", "input_len: lots"))
    with pytest.raises(ConfigError) as info:
        load_workspace(file)
    line = next(i for i, text in enumerate(good.splitlines(), 1) if "input_len: 128" in text)
    assert info.value.file is not None
    assert info.value.file.split(":")[-2] == str(line)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("target: {kind: server\nknobs: [", "while parsing a flow mapping"),
        ("target:\n\tkind: server\n", "character '\\t'"),
        ("{good}knobs: {{}}\n", "duplicate key 'knobs'"),
    ],
    ids=["unclosed-brace", "tab", "duplicate-key"],
)
def test_malformed_yaml_has_line_and_column(write_ws, good: str, text: str, problem: str) -> None:
    file = write_ws(text.format(good=good) if "{good}" in text else text)
    with pytest.raises(ConfigError) as info:
        load_workspace(file)
    err = info.value
    assert err.expected == "valid YAML"
    assert problem in str(err.got)
    assert err.file is not None
    path, line, col = err.file.rsplit(":", 2)
    assert path == str(file) and int(line) >= 1 and int(col) >= 1


def test_top_level_must_be_a_mapping(write_ws) -> None:
    file = write_ws("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping") as info:
        load_workspace(file)
    assert info.value.got == ["just", "a list"]


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="infra-agent.yaml"):
        load_workspace(tmp_path)


def test_several_problems_are_all_listed(write_ws, good: str) -> None:
    file = write_ws(good.replace("input_len: 128", "input_len: x").replace("num_requests: 10", "num_requests: -2"))
    with pytest.raises(ConfigError) as info:
        load_workspace(file)
    assert info.value.field == "scenarios.short.dataset.input_len"
    assert "1 more problem(s) at: scenarios.long.num_requests" in str(info.value)


def test_jsonl_path_resolves_against_workspace_root(write_ws, good: str) -> None:
    file = write_ws(good.replace("{kind: random, input_len: 128, output_len: 32}", "{kind: jsonl, path: data/p.jsonl, output_len: 8}"))
    (file.parent / "data").mkdir()
    (file.parent / "data" / "p.jsonl").write_text('{"prompt": "hi"}\n')
    ws = load_workspace(file)
    ds = ws.scenarios["short"].dataset
    assert isinstance(ds, JsonlDataset)
    assert ds.path == (file.parent / "data" / "p.jsonl").resolve()
    assert ds.prompt_field == "prompt"


def test_endpoint_target_and_single_scenario_criterion(write_ws) -> None:
    file = write_ws(
        "target: {kind: endpoint, url: 'http://127.0.0.1:9/', metrics_url: /metrics}\n"
        "scenarios: {only: {dataset: {kind: random, input_len: 8, output_len: 8}, num_requests: 4}}\n"
        "criteria: [{name: tput, metric: output_throughput, ratio: 0.9}]\n"
    )
    ws = load_workspace(file)
    assert isinstance(ws.target, EndpointTargetSpec)
    assert ws.target.url == "http://127.0.0.1:9"  # trailing slash dropped
    assert ws.criteria[0].scenario == "only"  # the one scenario is implied


def test_endpoint_url_must_be_http(write_ws) -> None:
    file = write_ws("target: {kind: endpoint, url: 'localhost:8000'}\n")
    with pytest.raises(ConfigError) as info:
        load_workspace(file)
    assert info.value.field == "target.url" and info.value.got == "localhost:8000"


def test_metric_directions_follow_vllm_keys() -> None:
    assert metric_direction("total_token_throughput") == "higher"
    assert metric_direction("request_goodput") == "higher"
    assert metric_direction("p99_ttft_ms") == "lower"
    assert metric_direction("p99.9_itl_ms") == "lower"
    assert metric_direction("median_e2el_ms") == "lower"
    assert metric_direction("failed") == "lower"
    assert metric_direction("something_else") is None


def test_custom_metric_is_accepted_with_an_op(write_ws, good: str) -> None:
    ws = load_workspace(write_ws(good.replace("metric: total_token_throughput", 'metric: server_prefill_mean_ms, custom: true, op: "<="')))
    assert (ws.criteria[0].metric, ws.criteria[0].custom, ws.criteria[0].op) == ("server_prefill_mean_ms", True, "<=")
    assert ws.criteria[1].custom is False
    # known metrics, every percentile form included, need no flag
    for metric in ("p99.9_itl_ms", "std_e2el_ms", "p100_tpot_ms", "total_output_tokens", "request_goodput"):
        assert load_workspace(write_ws(good.replace("metric: p99_ttft_ms", f"metric: {metric}, op: '<='"))).criteria[1].metric == metric


# (edit of GOOD, the whole message after "file:line:col: ") -- how a person reads it
MESSAGES = [
    (lambda t: t.replace("num_requests: 50", "num_requests: -1"), "scenarios.short.num_requests: expected a number greater than 0, got -1"),
    (lambda t: t.replace("num_requests: 50", "num_requests: 1.5"), "scenarios.short.num_requests: expected a valid integer, got 1.5"),
    (lambda t: t.replace("num_requests: 50", "num_requests: many"), "scenarios.short.num_requests: expected a valid integer, got 'many'"),
    (lambda t: t.replace("request_rate: inf", "request_rate: fast"), "scenarios.short.request_rate: expected a valid number, got 'fast'"),
    (lambda t: t.replace("request_rate: inf", "request_rate: 0"), "scenarios.short.request_rate: expected a number greater than 0, got 0"),
    (lambda t: t.replace("output_len: 32}", "output_len: 32, range_ratio: 1.5}"),
     "scenarios.short.dataset.range_ratio: expected a number less than 1, got 1.5"),
    (lambda t: t.replace("request_rate: inf", "request_rate: inf\n    warmup_requests: -1"),
     "scenarios.short.warmup_requests: expected a number greater than or equal to 0, got -1"),
    (lambda t: t.replace("slo: {ttft_ms: 500}", "slo: 5"), "scenarios.long.slo: expected a mapping (key: value lines, or {key: value}), got 5"),
    (lambda t: t.replace("endpoint: chat", "endpoint: chatt"), "scenarios.long.endpoint: expected 'completions' or 'chat', got 'chatt'"),
    (lambda t: t.replace("command: python -m http.server {port} --bind 127.0.0.1 --directory {root_dir}", "command: []"),
     "target.command: expected a valid string or a list of at least 1 item, got []"),
]


@pytest.mark.parametrize(("edit", "message"), MESSAGES, ids=[m[1].split(":")[0] + "-" + str(i) for i, m in enumerate(MESSAGES)])
def test_messages_read_as_one_sentence(write_ws, good: str, edit, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_workspace(write_ws(edit(good)))
    text = str(info.value)
    assert text.split(": ", 1)[1] == message
    assert "Input should" not in text and "should have" not in text and "Value error" not in text
    assert text.count("got") == 1


def test_translation_of_other_models_and_validator_messages() -> None:
    from pydantic import BaseModel, Field, ValidationError, field_validator

    from infra_agent.workspace.loader import expected_text, translate_validation_error

    class Step(BaseModel):
        name: str = Field(min_length=1)
        kind: str = "x"
        tries: list[int] = Field(default_factory=list, min_length=1)

        @field_validator("kind")
        @classmethod
        def _kind(cls, kind: str) -> str:
            if kind != "x":  # a validator that words its own message, "got" included
                raise ValueError(f"expected a kind among ['x'], got {kind!r}")
            return kind

    def problem(data: dict) -> ConfigError:
        try:
            Step.model_validate(data)
        except ValidationError as exc:
            return translate_validation_error(exc, "steps.yaml", root=Step)
        raise AssertionError("no error")

    assert str(problem({"name": "a", "kind": "y", "tries": [1]})) == "steps.yaml: kind: expected a kind among ['x'], got 'y'"
    assert str(problem({"name": "", "tries": [1]})) == "steps.yaml: name: expected text of at least 1 character, got ''"
    assert str(problem({"name": "a", "tries": []})) == "steps.yaml: tries: expected a list of at least 1 item, got []"
    assert expected_text({"type": "assertion_error", "msg": "Assertion failed, a positive count"}) == "a positive count"
