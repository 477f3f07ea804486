"""examples/kda-decode/spec.py through the kernel lab, as a user runs it on the CPU.

The check must pass (fused kernel vs the float64 reference, tiled vs fused), and the
bench's work accounting must flag the tiled form's repeated norm and gate and not the
fused one's: the counts come from the kernel's own counters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "examples" / "kda-decode" / "spec.py"


def _lab(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("infra-agent")
    cmd = [exe] if exe else [sys.executable, "-m", "infra_agent.cli.main"]
    env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "200"}
    return subprocess.run([*cmd, "kernel", *args, str(SPEC), "--device", "cpu", "--json"], env=env,
                          capture_output=True, text=True, timeout=600)


def test_check_passes_under_the_interpreter() -> None:
    res = _lab("check")
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    results = json.loads(res.stdout)["reports"][0]["results"]
    pairs = {(r["variant"], r["output"], r["status"]) for r in results}
    assert pairs == {(v, o, "passed") for v in ("kernel", "tiled") for o in ("o", "state")}, pairs


def test_work_accounting_flags_the_tiled_form_only() -> None:
    res = _lab("bench")
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    work = json.loads(res.stdout)["reports"][0]["work"]
    factors = {name: {op["op"]: op["repeat_factor"] for op in w["ops"]} for name, w in work.items()}
    # V=128 in 32-column tiles: four programs per (sequence, head) each redo the norm and gate.
    assert factors["tiled"]["l2norm_qk"] == factors["tiled"]["gate"] == 4.0
    assert factors["kernel"]["l2norm_qk"] == factors["kernel"]["gate"] == 1.0
    assert work["kernel"]["repeated_flops"] == 0 < work["tiled"]["repeated_flops"]
