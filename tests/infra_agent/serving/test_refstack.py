"""The client, the Prometheus deltas and the probe against the real refstack server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infra_agent.probes.base import ProbeContext
from infra_agent.probes.serving import ServingProbe
from infra_agent.serving.runner import run_benchmark
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Scenario

# Sampling (temperature 1): greedy decoding of refstack's random weights can produce a
# byte sequence that never forms UTF-8 text, i.e. a stream without any content token.
BASE = {"dataset": {"kind": "random", "input_len": 32, "output_len": 8, "seed": 3}, "temperature": 1.0}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refstack_client_and_server_phases(refstack_server, endpoint: str) -> None:  # type: ignore[no-untyped-def]
    sc = Scenario.model_validate({**BASE, "num_requests": 12, "max_concurrency": 4, "endpoint": endpoint})
    res = run_benchmark(refstack_server.url, sc, metrics_url=refstack_server.url + "/metrics", progress=False)
    assert res["completed"] == 12 and res["failed"] == 0, res["errors"]
    assert res["total_output_tokens"] == 12 * 8  # usage counts: ignore_eos honoured
    assert res["answer_lengths"] == {"checked": 12, "short": 0, "long": 0}
    assert res["model_id"].startswith("refstack")
    sm = res["server_metrics"]
    for phase in ("queue", "prefill", "decode", "ttft", "e2e"):
        assert sm[phase]["metric"] == f"refstack:{sm[phase]['metric'].split(':', 1)[1]}"
        assert sm[phase]["count"] == 12, phase  # the preflight request is outside the window
    # The client sees the server's time plus HTTP and event-loop overhead, never less.
    assert res["mean_e2el_ms"] >= sm["e2e"]["mean_s"] * 1e3 * 0.98
    assert res["mean_ttft_ms"] >= sm["ttft"]["mean_s"] * 1e3 * 0.98
    assert res["median_tpot_ms"] > 0 and res["mean_itl_ms"] > 0


def test_refstack_workspace_probe_with_step_delay(tmp_path: Path) -> None:
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "infra-agent.yaml").write_text(
        "target:\n"
        "  kind: server\n"
        f"  command: [{sys.executable!r}, -m, refstack.cli, serve, --preset, tiny, --port, '{{port}}', --step-delay-ms, '{{step_delay_ms}}']\n"
        "  ready_url: /health\n"
        "  metrics_url: /metrics\n"
        "  ready_timeout_s: 120\n"
        "knobs:\n"
        "  step_delay_ms: {type: float, min: 0, max: 1000, default: 0}\n"
        "scenarios:\n"
        "  tiny:\n"
        "    dataset: {kind: random, input_len: 32, output_len: 8, seed: 3}\n"
        "    num_requests: 8\n"
        "    max_concurrency: 2\n"
        "    temperature: 1.0\n"
    )
    ws = load_workspace(ws_dir)
    fb = ServingProbe().run({"knobs": {"step_delay_ms": 20}}, ProbeContext(workdir=tmp_path / "out", workspace=ws, progress=False))
    assert fb.ok, fb.error
    tpot = fb.measurement("tpot_ms", scenario="tiny", knob="step_delay_ms=20.0")
    assert tpot.value >= 20.0  # every engine step sleeps 20 ms, so each token takes at least that
    decode = fb.measurement("server_decode_mean_ms", scenario="tiny")
    assert decode.value >= 7 * 20.0  # 8 tokens: 7 decode steps after the first
    assert any(a.kind == "log" for a in fb.artifacts)
