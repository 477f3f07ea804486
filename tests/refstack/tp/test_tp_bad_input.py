"""Launches TP cannot serve are refused in one line at startup, naming the knob."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refstack.engine.config import EngineConfig
from refstack.model.config import HybridConfig
from refstack.tp.checks import TPConfigError, check_tp, tp_problem


@pytest.mark.parametrize(("knobs", "words"), [
    ({"tp": 3}, "--tp 3: the tiny preset's 4 KDA heads do not split over 3 ranks"),
    ({"tp": 4}, "--tp 4: the tiny preset's 2 KV heads do not split over 4 ranks"),
    ({"tp": 2, "quantization": "w8a8"}, "--tp 2 with --quantization w8a8"),
    ({"tp": 2, "kv_cache_dtype": "int8"}, "--tp 2 with --kv-cache-dtype int8"),
    ({"tp": 2, "kv_cache_dtype_layers": "1:bf16"}, "--kv-cache-dtype-layers 1:bf16"),
    ({"tp": 2, "kda_state_dtype": "bf16"}, "--tp 2 with --kda-state-dtype bf16"),
    ({"tp": 2, "cpu_kernels": "native"}, "--tp 2 with --cpu-kernels native"),
    ({"tp": 2, "kda_decode_kernel": "triton"}, "--tp 2 with --kda-decode-kernel triton"),
])
def test_a_launch_tp_cannot_serve_is_one_line_naming_the_knob(knobs: dict[str, object], words: str) -> None:
    problem = tp_problem(EngineConfig(**knobs))  # type: ignore[arg-type]
    assert problem is not None and words in problem and "\n" not in problem
    with pytest.raises(TPConfigError, match="pass "):
        check_tp(EngineConfig(**knobs))  # type: ignore[arg-type]


def test_a_vocabulary_that_does_not_split_is_refused() -> None:
    problem = tp_problem(EngineConfig(tp=2), model=HybridConfig.preset("tiny", vocab_size=511))
    assert problem is not None and "511 vocabulary entries do not split over 2 ranks" in problem


def test_tp_with_disagg_is_refused() -> None:
    assert "--tp 2 with --disagg" in str(tp_problem(EngineConfig(tp=2), disagg=True))


def test_single_rank_launches_are_not_tp() -> None:
    assert tp_problem(EngineConfig(tp=1, quantization="w8a8", kv_cache_dtype="int8")) is None
    assert tp_problem(EngineConfig(tp=2)) is None


@pytest.mark.parametrize(("flags", "words"), [
    (["--tp", "3"], "refstack: error: --tp 3: the tiny preset's 4 KDA heads do not split over 3 ranks"),
    (["--tp", "2", "--disagg", "true"], "refstack: error: --tp 2 with --disagg"),
])
def test_serve_refuses_before_spawning_a_rank(flags: list[str], words: str) -> None:
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--port", "0", *flags],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(words), r.stderr
