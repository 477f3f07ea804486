"""The Quick start's main job: `infra-agent demo` end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_every_step_and_reports_json(tmp_path: Path) -> None:
    workdir = tmp_path / "ws"
    proc = subprocess.run(
        [sys.executable, "-m", "infra_agent.cli.main", "demo", "--workdir", str(workdir), "--pairs", "3", "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["workspace", "serving", "knob-ab", "kernel-tp"]
    assert steps["workspace"]["outcome"] == "ok"
    # The workspace is a committed git repository generated from refstack's knob list.
    assert (workdir / "infra-agent.yaml").is_file() and (workdir / ".git").is_dir()
    assert "max_running" in steps["workspace"]["details"]["knobs"]
    # The serving probe measured real traffic and the server's own phase histograms.
    serving = steps["serving"]["feedback"]
    names = {m["name"] for m in serving["measurements"]}
    assert {"output_throughput", "ttft_ms", "server_prefill_mean_ms"} <= names
    # The A/B verdict comes with an interval from interleaved, paired runs.
    ab = steps["knob-ab"]
    assert ab["outcome"] in ("pass", "fail", "inconclusive")
    thr = next(m for m in ab["details"]["comparison"]["metrics"] if m["metric"] == "output_throughput")
    assert thr["ci"] is not None and thr["ci"]["low"] <= thr["ci"]["ratio"] <= thr["ci"]["high"]
    # Case study A: tf32 breaks TP agreement and 3xtf32 restores it (measured).
    assert steps["kernel-tp"]["outcome"] == "pass", steps["kernel-tp"]["summary"]
    assert (workdir / ".infra-agent" / "demo" / "demo.json").is_file()
