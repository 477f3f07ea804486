"""A valid workspace text that each bad-input test breaks in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

GOOD = """\
name: demo
target:
  kind: server
  command: python -m http.server {port} --bind 127.0.0.1 --directory {root_dir}
  ready_url: /
  metrics_url: /metrics
  env: {OMP_NUM_THREADS: 4}
knobs:
  max_running: {type: int, min: 1, max: 256, default: 16, components: [engine.scheduler]}
  precision: {type: choice, choices: [fp32, bf16], default: fp32}
  root_dir: {type: str, default: "."}
  delay: {type: float, min: 0, default: 0}
  trace: {type: bool, default: false}
scenarios:
  short:
    dataset: {kind: random, input_len: 128, output_len: 32}
    num_requests: 50
    request_rate: inf
  long:
    dataset: {kind: shared_prefix, prefix_len: 256, suffix_len: 16, output_len: 4, num_prefixes: 2}
    num_requests: 10
    endpoint: chat
    slo: {ttft_ms: 500}
criteria:
  - {name: prefill-throughput, metric: total_token_throughput, scenario: long, ratio: 0.95}
  - {name: ttft, metric: p99_ttft_ms, scenario: short, value: 250}
"""


@pytest.fixture
def good() -> str:
    return GOOD


@pytest.fixture
def write_ws(tmp_path: Path):
    """Write ``text`` as ``infra-agent.yaml`` in a fresh folder; return the file."""

    def write(text: str) -> Path:
        file = tmp_path / "infra-agent.yaml"
        file.write_text(text)
        return file

    return write
