"""`infra-agent validate`: a summary for good workspaces, exit 2 and a clean message for bad ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra_agent.cli.main import app

REPO = Path(__file__).resolve().parents[3]
runner = CliRunner()


def test_validate_prints_the_summary(write_ws, good: str) -> None:
    file = write_ws(good)
    result = runner.invoke(app, ["validate", str(file.parent)])
    assert result.exit_code == 0, result.output
    for text in ("max_running", "int in [1, 256]", "short", "long", "prefill-throughput", ">= 0.95 × baseline", "<= 250"):
        assert text in result.stdout


def test_validate_json_is_the_normalised_model(write_ws, good: str) -> None:
    file = write_ws(good)
    result = runner.invoke(app, ["validate", str(file), "--json", "--set", "max_running=32"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["source"] == str(file.resolve())
    assert data["workspace"]["knobs"]["max_running"]["default"] == 16
    assert data["workspace"]["scenarios"]["short"]["request_rate"] == "Infinity"
    assert data["workspace"]["criteria"][0]["op"] == ">="
    assert data["knob_values"]["max_running"] == 32


def test_example_workspace_validates_on_the_cli() -> None:
    result = runner.invoke(app, ["validate", str(REPO / "examples" / "refstack-serving")])
    assert result.exit_code == 0, result.output
    assert "prefill-throughput" in result.stdout


BAD = [
    ("malformed-yaml", lambda t: t + "knobs: [\n", [], "expected valid YAML"),
    ("unknown-key", lambda t: t + "colour: red\n", [], "colour: expected one of the keys"),
    ("wrong-type", lambda t: t.replace("input_len: 128", "input_len: lots"), [], "scenarios.short.dataset.input_len: expected a valid integer"),
    ("out-of-range", lambda t: t.replace("num_requests: 50", "num_requests: 0"), [], "scenarios.short.num_requests: expected a number greater than 0, got 0"),
    ("misspelled-metric", lambda t: t.replace("metric: total_token_throughput", 'metric: total_token_throughputt, op: ">="'), [],
     "criteria.0.metric: expected a metric a benchmark result holds (did you mean 'total_token_throughput'?), or `custom: true` on the criterion for a metric of your own, got 'total_token_throughputt'"),
    ("default-outside-domain", lambda t: t.replace("default: 16", "default: 0"), [], "knobs.max_running.default: expected int in [1, 256], got 0"),
    ("unknown-placeholder", lambda t: t.replace("{root_dir}", "{nope}"), [], "target.command: expected placeholders among {port}"),
    ("set-outside-domain", lambda t: t, ["--set", "max_running=1000"], "knobs.max_running: expected int in [1, 256], got '1000'"),
    ("set-unknown-knob", lambda t: t, ["--set", "max_runing=4"], "knobs: expected a declared knob (delay, max_running, precision, root_dir, trace), got 'max_runing'"),
    ("set-without-equals", lambda t: t, ["--set", "max_running"], "--set: expected name=value, got 'max_running'"),
]


@pytest.mark.parametrize(("edit", "args", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validate_bad_input_exits_2_without_traceback(write_ws, good: str, edit, args: list[str], message: str) -> None:
    file = write_ws(edit(good))
    result = runner.invoke(app, ["validate", str(file.parent), *args])
    assert result.exit_code == 2
    flat = " ".join(result.stderr.split())  # rich wraps long lines
    assert message in flat
    if not message.startswith("--set"):  # a malformed --set has no file to name
        assert str(file.resolve()) in flat.replace(" ", "") or str(file) in flat.replace(" ", "")
    assert "Traceback" not in result.output
    # --json: the same error as parseable JSON on stdout
    result = runner.invoke(app, ["validate", str(file.parent), *args, "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"] == "ConfigError"


def test_validate_in_a_real_process(write_ws, good: str) -> None:
    # The installed console script path, end to end: exit status and stderr as a user sees them.
    file = write_ws(good.replace("num_requests: 50", "num_requests: many"))
    proc = subprocess.run(
        [sys.executable, "-c", "from infra_agent.cli.main import app; app()", "validate", str(file.parent)],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "scenarios.short.num_requests" in proc.stderr and "many" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_validate_masks_secret_env_values_in_every_output(write_ws, good: str, monkeypatch: pytest.MonkeyPatch) -> None:
    token, key = "hf_aVeryPrivateToken123", "sk-another-secret-456"
    text = good.replace("env: {OMP_NUM_THREADS: 4}", f"env: {{OMP_NUM_THREADS: 4, HF_TOKEN: {token}, OPENAI_API_KEY: {key}}}")
    text = text.replace("--directory {root_dir}", f"--directory {{root_dir}} --hf-token {token}")
    file = write_ws(text)
    monkeypatch.setenv("MY_SERVICE_PASSWORD", "process-level-secret")
    human = runner.invoke(app, ["validate", str(file.parent)])
    assert human.exit_code == 0, human.output
    flat = " ".join(human.stdout.split())
    assert "HF_TOKEN=*** OPENAI_API_KEY=***" in flat and "OMP_NUM_THREADS=4" in flat
    assert "--hf-token ***" in flat
    js = runner.invoke(app, ["validate", str(file.parent), "--json"])
    assert js.exit_code == 0, js.output
    data = json.loads(js.stdout)
    assert data["workspace"]["target"]["env"] == {"OMP_NUM_THREADS": "4", "HF_TOKEN": "***", "OPENAI_API_KEY": "***"}
    assert data["workspace"]["target"]["command"].endswith("--hf-token ***")
    for out in (human.output, js.output):
        assert token not in out and key not in out
    # a secret of the environment validate runs in is masked where it recurs too
    file = write_ws(good.replace("--directory {root_dir}", "--directory {root_dir} --password process-level-secret"))
    for args in ([], ["--json"]):
        res = runner.invoke(app, ["validate", str(file.parent), *args])
        assert res.exit_code == 0 and "process-level-secret" not in res.output
    # a knob whose name only looks secret keeps its value
    file = write_ws(good.replace("knobs:\n", "knobs:\n  max_num_batched_tokens: {type: int, min: 1, default: 8192}\n"))
    data = json.loads(runner.invoke(app, ["validate", str(file.parent), "--json"]).stdout)
    assert data["knob_values"]["max_num_batched_tokens"] == 8192
