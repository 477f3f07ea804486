"""`refstack knobs` / `refstack serve` flags: typed knobs, help, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import httpx
import pytest

from refstack.engine.config import EngineConfig
from refstack.knobs import KNOBS, KnobError, engine_config, knob, parse_knobs

REQUIRED = {"preset", "host", "port", "max_running", "max_batch_tokens", "prefill_chunk", "max_waiting", "num_slots",
            "max_seq_len", "seed", "lm_head_precision", "dtype", "torch_threads", "step_delay_ms",
            "max_request_bytes"}


def refstack(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "refstack.cli", *args], capture_output=True, text=True, timeout=60)


def test_knobs_json_lists_every_knob_with_its_domain() -> None:
    r = refstack("knobs", "--json")
    assert r.returncode == 0, r.stderr
    listed = {k["name"]: k for k in json.loads(r.stdout)}
    assert REQUIRED <= set(listed)
    for k in listed.values():
        # changes_outputs only where true: a knob meant to change what the model answers
        assert set(k) - {"changes_outputs"} == {"name", "flag", "type", "domain", "default", "components", "help"}
        assert k["components"] and k["help"] and k.get("changes_outputs", True) is True
    changing = {name for name, k in listed.items() if k.get("changes_outputs")}
    assert {"seed", "lm_head_precision", "dtype", "quantization", "kv_cache_dtype"} <= changing
    assert not changing & {"max_running", "max_batch_tokens", "torch_threads", "cpu_kernels", "step_delay_ms"}
    assert listed["lm_head_precision"]["domain"] == {"choices": ["fp32", "tf32", "3xtf32", "bf16"]}
    assert listed["dtype"]["domain"] == {"choices": ["auto", "float32", "bfloat16"]} and listed["dtype"]["default"] == "auto"
    assert listed["step_delay_ms"]["domain"]["min"] == 0.0 and "calibration" in listed["step_delay_ms"]["help"].lower()
    assert listed["max_running"]["domain"]["min"] == 1
    assert listed["max_request_bytes"]["default"] == 1 << 20 and listed["max_request_bytes"]["components"] == ["server"]


def test_every_knob_names_components_of_the_shared_vocabulary() -> None:
    """A workspace built from ``refstack knobs --json`` validates each knob's components
    against infra_agent's vocabulary: a name outside it would fail that workspace."""
    from infra_agent.vocabulary import check_component

    bad = {(k.name, c): check_component(c) for k in KNOBS for c in k.components if check_component(c)}
    assert not bad, bad
    assert all(k.components for k in KNOBS)


def test_serve_help_shows_every_knob() -> None:
    r = refstack("serve", "--help")
    assert r.returncode == 0
    for k in KNOBS:
        assert k.flag in r.stdout, k.flag


@pytest.mark.parametrize("args", [
    ["serve", "--no-such-knob", "1"],
    ["serve", "--max-running", "0"],
    ["serve", "--max-running", "lots"],
    ["serve", "--lm-head-precision", "fp8"],
    ["serve", "--dtype", "float16"],
    ["serve", "--step-delay-ms", "-1"],
    ["serve", "--port", "70000"],
    ["serve", "--max-request-bytes", "10"],
    ["frobnicate"],
])
def test_bad_flags_exit_non_zero_with_one_line(args: list[str]) -> None:
    r = refstack(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refstack: error:"), r.stderr
    assert "refstack serving" not in r.stdout


def test_engine_knobs_are_exactly_the_engine_config_fields() -> None:
    server_only = {"host", "port", "log_level", "max_request_bytes", "disagg"}
    assert {k.name for k in KNOBS} - server_only == {f.name for f in dataclasses.fields(EngineConfig)}
    cfg = engine_config(parse_knobs({"max_running": "4", "lm_head_precision": "bf16", "trace": "yes"}))
    assert (cfg.max_running, cfg.lm_head_precision, cfg.trace, cfg.max_batch_tokens) == (4, "bf16", True, 512)


def test_knob_parse_checks_type_and_domain() -> None:
    assert knob("step_delay_ms").parse("2.5") == 2.5
    for name, bad in [("seed", "-1"), ("step_delay_ms", "nan"), ("preset", "huge"), ("trace", "maybe")]:
        with pytest.raises(KnobError):
            knob(name).parse(bad)
    with pytest.raises(KnobError, match="--max-running"):
        parse_knobs({"max_running": "0"})


def test_native_kernels_without_a_compiler(tmp_path, refstack_server_factory) -> None:  # type: ignore[no-untyped-def]
    """--cpu-kernels native refuses to start in one line; auto falls back to torch and serves."""
    env = {"CC": str(tmp_path / "no-such-cc"), "REFSTACK_KERNEL_CACHE": str(tmp_path / "empty-cache")}
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--cpu-kernels", "native"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, **env}, check=False)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refstack: error: --cpu-kernels native: no C compiler"), r.stderr
    server = refstack_server_factory(env=env)
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert "native CPU kernels unavailable (no C compiler" in server.log()
    # dtype=auto: without the native kernels, bf16 GEMMs would be torch's slower reference path.
    engine = httpx.get(server.url + "/debug/engine", timeout=10).json()
    assert (engine["dtype"], engine["native_kernels"], engine["config"]["dtype"]) == ("float32", False, "auto")


def test_a_bad_trace_level_in_the_environment_is_one_line_before_startup() -> None:
    """INFRA_AGENT_TRACE_LEVEL is read when the tracer is first asked for; serve asks
    before it builds anything, so a misspelt level is a one-line error, not a traceback
    from inside the app."""
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--trace", "true", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "INFRA_AGENT_TRACE_LEVEL": "stpe"},
                       check=False)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refstack: error: trace level 'stpe'"), r.stderr
    assert "INFRA_AGENT_TRACE_LEVEL" in lines[0] and "'step'" in lines[0]
