"""Knob domains from ``vllm serve --help``: parsed from a recorded excerpt (vLLM 0.32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.errors import ConfigError
from infra_agent.serving.serve_help import knob_spec, parse_help
from infra_agent.workspace import load_workspace

ROOT = Path(__file__).resolve().parents[3]
HELP = (Path(__file__).with_name("fixtures") / "vllm-0.32-serve-help-excerpt.txt").read_text()


def test_parse_help_reads_flags_metavars_choices_and_defaults() -> None:
    opts = parse_help(HELP)
    assert {"enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
            "gpu_memory_utilization", "kv_cache_dtype", "prefix_caching_hash_algo"} <= set(opts)
    seqs = opts["max_num_seqs"]
    assert seqs.flags == ["--max-num-seqs"] and seqs.metavar == "MAX_NUM_SEQS" and seqs.default == "None"
    assert seqs.text.startswith("Maximum number of sequences")
    pair = opts["enable_prefix_caching"]
    assert pair.negatable and pair.flags == ["--enable-prefix-caching", "--no-enable-prefix-caching"]
    kv = opts["kv_cache_dtype"]
    assert kv.choices is not None and kv.choices[:3] == ["auto", "bfloat16", "float16"] and "fp8_e5m2" in kv.choices
    assert kv.default == "auto"
    # A second spelling of the flag, and a default printed on a line of its own.
    mem = opts["gpu_memory_utilization"]
    assert mem.flags == ["--gpu-memory-utilization", "--device-memory-utilization"] and mem.default == "0.92"
    assert opts["max_num_batched_tokens"].default is None  # the excerpt cuts its "(default: ...)"


def test_knob_spec_types_from_help() -> None:
    opts = parse_help(HELP)
    assert knob_spec(opts, "max_num_seqs", "int", min=1, max=4096) == {
        "type": "int", "min": 1, "max": 4096, "help": "Maximum number of sequences to be processed in a single iteration."}
    pair = knob_spec(opts, "enable_prefix_caching")
    assert pair["type"] == "choice" and pair["choices"] == ["--enable-prefix-caching", "--no-enable-prefix-caching"]
    assert "default" not in pair  # vLLM prints None: it decides per model
    kv = knob_spec(opts, "kv_cache_dtype")
    assert kv["type"] == "choice" and kv["default"] == "auto"
    assert knob_spec(opts, "gpu_memory_utilization", "float")["default"] == pytest.approx(0.92)
    with pytest.raises(ConfigError, match="max_num_seq.*close: max_num_seqs"):
        knob_spec(opts, "max_num_seq")


def test_example_workspaces_validate_and_vllm_domains_follow_its_help() -> None:
    vllm = load_workspace(ROOT / "examples" / "vllm-serving")
    sglang = load_workspace(ROOT / "examples" / "sglang-serving")
    assert vllm.target.metrics_url == "/metrics" and sglang.target.metrics_url == "/metrics"
    assert "--enable-metrics" in str(sglang.target.command)
    opts = parse_help(HELP)
    for name in ("enable_chunked_prefill", "enable_prefix_caching", "kv_cache_dtype"):
        from_help = knob_spec(opts, name)["choices"]
        assert set(vllm.knobs[name].choices or []) <= set(from_help), name
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        assert f"--{name.replace('_', '-')} {{{name}}}" in str(vllm.target.command)


SGLANG_HELP = (Path(__file__).with_name("fixtures") / "sglang-0.5.23-launch-server-help-excerpt.txt").read_text()


def test_sglang_domains_follow_its_launcher_help() -> None:
    """The SGLang example against ``python -m sglang.launch_server --help`` (SGLang 0.5.23,
    the argparse of its own ServerArgs): every flag the command places exists, the choice
    knobs' values are the launcher's, and the radix-cache knob's values are bare switches."""
    sglang = load_workspace(ROOT / "examples" / "sglang-serving")
    opts = parse_help(SGLANG_HELP)
    command = str(sglang.target.command)
    placed = {flag for flag in command.split() if flag.startswith("--")}
    known = {f for opt in opts.values() for f in opt.flags} | {"--port", "--host"}  # not in the excerpt
    assert placed <= known, placed - known
    for name in ("schedule_policy", "kv_cache_dtype"):
        from_help = knob_spec(opts, name)["choices"]
        assert set(sglang.knobs[name].choices or []) <= set(from_help), (name, from_help)
    for flag in sglang.knobs["radix_cache"].choices or []:
        opt = opts[flag.removeprefix("--").replace("-", "_")]
        assert opt.flags == [flag] and opt.metavar is None, flag  # a switch: it takes no value
    for name in ("context_length", "max_running_requests", "chunked_prefill_size", "max_prefill_tokens",
                 "mem_fraction_static"):
        assert f"--{name.replace('_', '-')} {{{name}}}" in command and name in opts, name
