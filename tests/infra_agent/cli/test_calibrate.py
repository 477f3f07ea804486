"""``infra-agent calibrate`` on real refstack servers: A/A blocks, the file the loop reads, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "refstack-serving"
CLI = [sys.executable, "-m", "infra_agent.cli.main"]


def _workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(EXAMPLE, ws)
    cfg = ws / "infra-agent.yaml"
    # Fewer requests per window: the test is about the blocks, not the numbers.
    cfg.write_text(cfg.read_text().replace("num_requests: 64", "num_requests: 12"))
    return ws


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)
def test_calibrate_runs_fresh_aa_blocks_and_writes_what_the_loop_reads(tmp_path: Path) -> None:
    from infra_agent.judge.process_noise import resolve, shows_spread
    from infra_agent.serving.noise_record import Machine, load

    ws = _workspace(tmp_path)
    done = _cli("calibrate", str(ws), "--scenario", "short-chat", "--blocks", "2", "--pairs", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert Path(out["file"]) == ws / ".infra-agent" / "process-noise.json"
    assert out["scenario"] == "short-chat" and out["blocks"] == 2 and out["pairs_per_block"] == 2
    metrics = out["metrics"]
    # The criterion's metric and the benchmark's own statistics, each from 2 blocks of 2 pairs.
    assert {"p99_ttft_ms", "output_throughput", "median_itl_ms"} <= set(metrics)
    assert not any(name.startswith("std_") for name in metrics)
    for m in metrics.values():
        assert m["tau"] >= 0 and m["within_sd"] > 0 and m["df"] == [1, 2] and m["pairs"] == 4
    cal = load(ws)
    assert cal is not None and cal.machine == Machine.here()
    # The loop adds a metric's spread only where the F test shows one.
    shown = {name: m["tau"] for name, m in metrics.items() if shows_spread(m["p"])}
    noise = resolve(ws, "auto")
    if any(shown.values()):
        assert noise is not None
        assert noise.taus == {name: shown.get(name, 0.0) for name in metrics}
    else:
        assert noise is None

    human = _cli("calibrate", str(ws), "--scenario", "short-chat", "--blocks", "2", "--pairs", "2")
    assert human.returncode == 0, human.stderr
    assert "block 2/2, window 2/2" in human.stderr and "one batch detects" in human.stdout
    assert "the loop adds" in human.stdout
    assert "process-noise.json" in human.stdout


def test_bad_input_exits_2_and_names_what_was_wrong(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    unknown = _cli("calibrate", str(ws), "--scenario", "nope")
    assert unknown.returncode == 2 and "--scenario" in unknown.stderr and "short-chat" in unknown.stderr
    one = _cli("calibrate", str(ws), "--blocks", "1")
    assert one.returncode == 2 and "--blocks" in one.stderr
    assert not (ws / ".infra-agent" / "process-noise.json").exists()


def test_a_damaged_calibration_stops_a_run_before_anything_is_recorded(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    path = ws / ".infra-agent" / "process-noise.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    done = _cli("run", str(ws), "--budget-runs", "1", "--no-report", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "process-noise.json" in done.stderr and "calibrate" in done.stderr
    assert not (ws / ".infra-agent" / "ledger.db").exists()
    bad = _cli("run", str(ws), "--process-noise", "lots", "--no-report", timeout=120)
    assert bad.returncode == 2 and "--process-noise" in bad.stderr
