from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from infra_agent.serving.prom import parse_histogram_totals, phase_deltas

# vLLM's exposition format, label sets included (two engines of one model).
VLLM_BEFORE = """\
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 3.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.0
vllm:request_queue_time_seconds_bucket{engine="1",le="0.3",model_name="m"} 1.0
vllm:request_queue_time_seconds_bucket{engine="1",le="+Inf",model_name="m"} 1.0
vllm:request_queue_time_seconds_count{engine="1",model_name="m"} 1.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 0.5
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""
VLLM_AFTER = VLLM_BEFORE.replace('_count{engine="0",model_name="m"} 4.0', '_count{engine="0",model_name="m"} 10.0').replace(
    '_sum{engine="0",model_name="m"} 1.0', '_sum{engine="0",model_name="m"} 2.5'
).replace('_count{engine="1",model_name="m"} 1.0', '_count{engine="1",model_name="m"} 3.0').replace(
    '_sum{engine="1",model_name="m"} 0.5', '_sum{engine="1",model_name="m"} 1.5'
)


def test_vllm_text_delta_sums_label_sets() -> None:
    before, after = parse_histogram_totals(VLLM_BEFORE), parse_histogram_totals(VLLM_AFTER)
    d = phase_deltas(before, after)
    # Only the queue histogram is in this text: vLLM's other phases are reported missing.
    assert [p for p, v in d.items() if not v.get("missing")] == ["queue"]
    assert d["tpot"] == {"metric": None, "count": None, "sum_s": None, "mean_s": None, "missing": True,
                         "expected": ["vllm:request_time_per_output_token_seconds"]}
    q = d["queue"]
    assert q["metric"] == "vllm:request_queue_time_seconds"
    assert q["count"] == 8  # (10 - 4) + (3 - 1)
    assert q["sum_s"] == pytest.approx(2.5)  # (2.5 - 1.0) + (1.5 - 0.5)
    assert q["mean_s"] == pytest.approx(2.5 / 8)


def test_refstack_histograms_from_prometheus_client() -> None:
    reg = CollectorRegistry()
    prefill = Histogram("refstack:request_prefill_time_seconds", "prefill", registry=reg)
    e2e = Histogram("refstack:e2e_request_latency_seconds", "e2e", registry=reg)
    prefill.observe(0.5)
    before = parse_histogram_totals(generate_latest(reg).decode())
    for v in (0.1, 0.2, 0.3):
        prefill.observe(v)
        e2e.observe(v * 10)
    after = parse_histogram_totals(generate_latest(reg).decode())
    d = phase_deltas(before, after)
    assert d["prefill"]["count"] == 3 and d["prefill"]["mean_s"] == pytest.approx(0.2)
    assert d["e2e"]["count"] == 3 and d["e2e"]["mean_s"] == pytest.approx(2.0)
    assert d["queue"]["missing"] and d["queue"]["mean_s"] is None  # not exposed -> reported missing, not invented
    assert "itl" not in d and "inference" not in d  # refstack has no such histogram at all


def test_counter_reset_is_flagged_not_reported() -> None:
    d = phase_deltas(parse_histogram_totals(VLLM_AFTER), parse_histogram_totals(VLLM_BEFORE))
    assert d["queue"]["reset"] is True and d["queue"]["mean_s"] is None


FIXTURES = Path(__file__).with_name("fixtures")


def _fixture_deltas(stem: str) -> dict:
    before = parse_histogram_totals((FIXTURES / f"{stem}-before.txt").read_text())
    after = parse_histogram_totals((FIXTURES / f"{stem}-after.txt").read_text())
    return phase_deltas(before, after)


def test_recorded_vllm_metrics_map_every_phase() -> None:
    # /metrics of a vLLM 0.32 CPU server before and after two 16-token answers.
    d = _fixture_deltas("vllm-0.32-cpu-metrics")
    assert list(d) == ["queue", "prefill", "decode", "inference", "ttft", "tpot", "itl", "e2e"]
    assert not any(v.get("missing") for v in d.values())
    assert d["tpot"]["metric"] == "vllm:request_time_per_output_token_seconds"  # the phase once silently absent
    assert d["itl"]["metric"] == "vllm:inter_token_latency_seconds"
    assert all(d[p]["count"] == 2 for p in ("queue", "prefill", "decode", "inference", "ttft", "tpot", "e2e"))
    assert d["itl"]["count"] == 2 * 15  # one sample per token after the first
    # A request's prefill and decode make up its inference time, on the server's clock.
    assert d["prefill"]["sum_s"] + d["decode"]["sum_s"] == pytest.approx(d["inference"]["sum_s"], rel=1e-6)


def test_sglang_names_map_onto_the_same_phases() -> None:
    d = _fixture_deltas("sglang-metrics")
    assert list(d) == ["queue", "prefill", "ttft", "itl", "e2e"]  # SGLang has no decode/TPOT histogram
    assert d["prefill"]["metric"] == 'sglang:per_stage_req_latency_seconds{stage="prefill_forward"}'
    assert d["prefill"]["count"] == 3 and d["prefill"]["mean_s"] == pytest.approx(0.012)
    assert d["queue"]["count"] == 3 and d["queue"]["mean_s"] == pytest.approx((0.004 + 0.030 + 0.050) / 3)
    assert d["ttft"]["mean_s"] == pytest.approx(0.045) and d["e2e"]["mean_s"] == pytest.approx(0.2)
    assert d["itl"]["count"] == 21  # 7 gaps per request


def test_a_phase_the_stack_exports_but_the_scrape_lacks_is_missing() -> None:
    text = (FIXTURES / "vllm-0.32-cpu-metrics-after.txt").read_text()
    # An older or trimmed vLLM: no per-request TPOT histogram in the text.
    trimmed = "\n".join(line for line in text.splitlines() if "request_time_per_output_token" not in line) + "\n"
    d = phase_deltas(parse_histogram_totals(trimmed), parse_histogram_totals(trimmed))
    assert d["tpot"]["missing"] and d["tpot"]["expected"] == ["vllm:request_time_per_output_token_seconds"]
    assert d["e2e"]["count"] == 0 and not d["e2e"].get("missing")
    assert phase_deltas({}, {}) == {}  # no known stack at all: nothing to expect
