"""Smoke test of bench/tracer_overhead.py: a tiny ``--quick --json`` run has the structure
docs and readers rely on (the numbers are the full run's business, not this test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from refstack.engine.config import EngineConfig

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tracer_overhead.py"
SETTINGS = ("off", "tracing (layer level)", "tracing (step level)", "off (E2E)", "tracing (layer level, E2E)",
            "tracing (step level, E2E)", "off (whole window)", "tracing (step level, whole window)", "pyspy",
            "off (profiler worker)", "torch_profiler", "off (E2E, profiler server)", "torch_profiler (E2E)")
E2E_PAIRED = ("tracing (layer level, E2E)", "tracing (step level, E2E)")
E2E_ROWS = (*E2E_PAIRED, "off (E2E, profiler server)", "torch_profiler (E2E)")


def _run(repeats: int, env: dict[str, str] | None = None, *extra: str) -> tuple[dict[str, Any], str]:
    # The smallest workload and tiny windows keep a run to seconds; the structure is the same.
    cmd = [sys.executable, str(BENCH), "--quick", "--json", "--batch", "1", "--prompt-len", "4", "--gen-len", "4",
           "--repeats", str(repeats), "--window-s", "0.02", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr  # --json without a path: the document alone on stdout


def test_quick_json_run_reports_every_setting_with_ratio_interval_and_verdict() -> None:
    doc, stderr = _run(10)  # 10 cycles: the path a full run takes (bootstrap CI of the median ratio)
    assert "| setting | tok/s median [95% CI] | ratio vs off [95% CI]" in stderr  # the table went to stderr

    meta = doc["meta"]
    assert meta["quick"] is True and meta["repeats"] == 10 and meta["calls_per_window"] >= 1
    assert meta["goal_max_overhead"] == 0.02 and meta["command"].startswith("python bench/tracer_overhead.py")
    assert set(doc["settings"]) == set(SETTINGS)
    # The goal's row is the level `refstack serve --trace true` records, end to end.
    assert EngineConfig().trace_level == "step"
    assert doc["goal"] == {"setting": "tracing (step level, E2E)", "level": "step", "max_overhead": 0.02,
                           "outcome": doc["settings"]["tracing (step level, E2E)"]["verdict"],
                           "layer_level_outcome": doc["settings"]["tracing (layer level, E2E)"]["verdict"],
                           "engine_outcome": doc["settings"]["tracing (step level)"]["verdict"],
                           "engine_layer_level_outcome": doc["settings"]["tracing (layer level)"]["verdict"]}

    assert set(meta["gc_objects"]) == {"main", "profiler"}
    for name in ("off", "off (E2E)", "off (whole window)", "off (profiler worker)",
                 "off (E2E, profiler server)"):  # each baseline
        off = doc["settings"][name]
        assert off["available"] and len(off["tokens_per_s"]) == 10 and "ratio" not in off
        assert off["ci"][0] <= off["median"] <= off["ci"][1]
    assert meta["e2e_calls_per_window"] >= 1
    for name in ("tracing (layer level)", "tracing (step level)", *E2E_PAIRED, "tracing (step level, whole window)",
                 "torch_profiler", "torch_profiler (E2E)"):
        row = doc["settings"][name]
        # One ratio per cycle; our paired rows keep their per-call ratios beside them.
        paired = name in ("tracing (layer level)", "tracing (step level)", *E2E_PAIRED)
        calls = meta["e2e_calls_per_window"] if name in E2E_PAIRED else meta["calls_per_window"]
        assert row["available"] and len(row["tokens_per_s"]) == len(row["ratios"]) == 10
        assert len(row.get("call_ratios", [])) == (10 * calls if paired else 0)
        assert row["ratio_ci"][0] <= row["ratio"] <= row["ratio_ci"][1]
        assert abs(row["overhead"] - (1 - row["ratio"])) < 1e-12
        assert row["verdict"] in ("pass", "fail", "inconclusive")
        unit = "cycles, each the median of its paired calls" if paired else "cycles"
        assert f"bootstrap CI of the median ratio over 10 {unit}" in row["interval"]
        if name in meta["events_per_generate"]:
            assert meta["events_per_generate"][name] > 0  # the setting recorded the engine's work: a real cost
    assert {"tracing (layer level)", "tracing (step level)", "torch_profiler"} <= set(meta["events_per_generate"])

    spy = doc["settings"]["pyspy"]
    if spy["available"]:
        assert spy["sample_hz_median"] > 0 and spy["verdict"] in ("pass", "fail", "inconclusive")
    else:  # no ptrace, or py-spy missing: reported, not a crash
        assert spy["reason"].startswith("unavailable: ")


def test_without_py_spy_the_run_says_why_and_still_reports_the_rest() -> None:
    # An empty PATH hides py-spy (the interpreter is called by its absolute path); 3 cycles
    # take the judge's small-sample t-interval.  --no-e2e: no server (the first test has one).
    doc, _ = _run(3, {**os.environ, "PATH": ""}, "--no-e2e")
    assert doc["settings"]["pyspy"] == {"available": False,
                                        "reason": "unavailable: py-spy is not on PATH (pip install py-spy, in the test extras)"}
    for name in ("off (E2E)", *E2E_ROWS):
        assert doc["settings"][name] == {"available": False, "reason": "unavailable: skipped (--no-e2e)"}
    assert doc["goal"]["setting"] == "tracing (step level)"  # the engine's row stands in
    tracing = doc["settings"]["tracing (layer level)"]
    assert len(tracing["ratios"]) == 3 and len(tracing["call_ratios"]) == 3 * doc["meta"]["calls_per_window"]
    assert "t-interval of the geometric-mean ratio over 3 cycles, each the median of its paired calls" in tracing["interval"]
    assert tracing["ratio_ci"][0] <= tracing["ratio"] <= tracing["ratio_ci"][1]
