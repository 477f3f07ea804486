"""bench/quantization.py's structure on the tiny preset (a smoke run, no numbers checked):
every table and every setting appears, and a setting the engine cannot build prints
"not implemented" instead of crashing the run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
ARGS = ["--preset", "tiny", "--quick", "--batches", "2", "4", "--repeats", "1", "--gen-len", "4",
        "--quality-prompts", "3", "--quality-steps", "3", "--context", "256"]
NAMES = ("bf16", "w8a8", "w8a8-all", "kv-bf16", "kv-fp8", "kv-int8", "kv-mixed")


def _bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the script imports its neighbours (engine_throughput, engine_gate)
    spec = importlib.util.spec_from_file_location("quantization_bench", BENCH / "quantization.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_quick_run_prints_every_table_and_setting(capsys: pytest.CaptureFixture[str]) -> None:
    results: dict[str, Any] = _bench().main(ARGS)
    out = capsys.readouterr().out
    for heading in ("## decode throughput", "## the model's decode forward alone at batch 4", "## KV cache bytes",
                    "## quality vs bf16", "## goals"):
        assert heading in out, heading
    built = [n for n in NAMES if n not in results["errors"]]
    assert {"bf16", "w8a8"} <= set(built), results["errors"]
    for name in NAMES:
        if name in built:
            assert f"| {name} | 2 |" in out and f"| {name} | 4 |" in out, name  # a speed row per batch
            assert results["memory"][name]["kv_bytes_per_token"] > 0
            if name != "bf16":
                assert 0.0 <= results["quality_vs_bf16"][name]["top1"] <= 1.0
        else:
            assert f"{name}: not implemented" in out
    assert "- W8A8 >= 1.3x bf16 decode at batch 4 with top-1 >= 0.98:" in out
    assert len(results["samples"]["wall"][4]["w8a8"]) == len(results["samples"]["step"][4]["w8a8"]) == 1
    # the forward-alone bound: one median per repeat, for every setting that was built
    assert set(results["forward_us"]) == set(built) and all(len(v) == 1 and v[0] > 0 for v in results["forward_us"].values())
    assert "the model's forward alone" in out


def test_a_setting_the_engine_refuses_is_reported_not_raised(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench()
    real = bench.make_engine

    def refusing(model: Any, preset: str, batch: int, prompt_len: int, max_seq_len: int, knobs: dict[str, Any],
                 device: str = "cpu") -> Any:
        if knobs.get("kv_cache_dtype") == "int8":
            raise NotImplementedError("int8 KV storage is not wired yet")
        return real(model, preset, batch, prompt_len, max_seq_len, knobs, device)

    monkeypatch.setattr(bench, "make_engine", refusing)
    results = bench.main([*ARGS, "--settings", "kv-int8", "kv-bf16"])
    out = capsys.readouterr().out
    assert results["errors"]["kv-int8"].startswith("not implemented (NotImplementedError: int8 KV storage")
    assert "kv-int8: not implemented" in out and "| kv-int8 |" not in out
    assert "- kv-int8: not measured (not implemented" in out
