"""The throughput benchmark's correctness gate (bench/engine_gate.py) on the tiny preset:
it passes a faithful native path and stops on a broken one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from refstack.model import HybridConfig, HybridModel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine_gate.py"
PROMPTS = [[(7 * b + 3 * i) % 256 for i in range(12)] for b in range(4)]


def _gate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_gate", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pair(dtype: str) -> tuple[HybridModel, HybridModel]:
    native, reference = (HybridModel(HybridConfig.preset("tiny", dtype=dtype)) for _ in range(2))
    native.use_native_kernels(True)
    return native, reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gate_passes_the_native_path_and_reports_each_check(dtype: str) -> None:
    lines = _gate().check_gate(*_pair(dtype), PROMPTS, steps=4)
    assert lines[0].startswith(f"native vs torch path, {dtype}:") and "at 100.0% of 20 positions" in lines[0]
    if dtype == "bfloat16":
        assert len(lines) == 2 and lines[1].startswith("bf16 vs fp32 model: greedy token agrees at")
    else:
        assert len(lines) == 1


def test_the_gate_stops_a_native_path_that_computes_something_else() -> None:
    native, reference = _pair("float32")
    with torch.no_grad():
        native.lm_head.packed.mul_(1.01)  # a 1% error in one kernel's weights
    with pytest.raises(SystemExit, match="correctness gate failed: native vs torch path, float32"):
        _gate().check_gate(native, reference, PROMPTS, steps=4)
