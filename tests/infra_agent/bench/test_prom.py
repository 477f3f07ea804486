from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from infra_agent.bench.prom import parse_histogram_totals, phase_deltas

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
    assert set(d) == {"queue"}
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
    assert "queue" not in d  # not exposed -> not invented


def test_counter_reset_is_flagged_not_reported() -> None:
    d = phase_deltas(parse_histogram_totals(VLLM_AFTER), parse_histogram_totals(VLLM_BEFORE))
    assert d["queue"]["reset"] is True and d["queue"]["mean_s"] is None
