from __future__ import annotations

import numpy as np
import pytest

from infra_agent.serving.client import RequestRecord
from infra_agent.serving.metrics import SLO, compute_metrics, request_samples, tpot_of


def ok(ttft: float, latency: float, out: int, itl: list[float] | None = None, prompt: int = 10) -> RequestRecord:
    return RequestRecord(success=True, prompt_len=prompt, output_len=out, ttft=ttft, latency=latency, itl=itl or [])


def failed(err: str = "boom") -> RequestRecord:
    # A failed record with absurd timings: none of them may leak into the summaries.
    return RequestRecord(success=False, prompt_len=10, output_len=99, ttft=100.0, latency=500.0, itl=[50.0], error=err, error_kind="other")


def test_tpot_only_when_more_than_one_output_token() -> None:
    assert tpot_of(ok(0.2, 1.0, 5)) == pytest.approx(0.2)  # (1.0 - 0.2) / (5 - 1)
    assert tpot_of(ok(0.2, 0.3, 1)) is None
    recs = [ok(0.2, 1.0, 5), ok(0.1, 0.1, 1)]
    res = compute_metrics(recs, duration=2.0)
    assert res["mean_tpot_ms"] == pytest.approx(200.0)  # the one-token request is left out
    assert res["mean_ttft_ms"] == pytest.approx(150.0)  # but it still has a TTFT


def test_failed_requests_counted_apart_and_never_in_latencies() -> None:
    good = [ok(0.1, 0.5, 5, itl=[0.1] * 4), ok(0.3, 0.7, 5, itl=[0.1] * 4)]
    res = compute_metrics([*good, failed("HTTP 500"), failed("timeout")], duration=4.0)
    assert res["completed"] == 2 and res["failed"] == 2
    assert res["mean_ttft_ms"] == pytest.approx(200.0)
    assert res["median_e2el_ms"] == pytest.approx(600.0)
    assert res["mean_itl_ms"] == pytest.approx(100.0)
    assert res["total_output_tokens"] == 10 and res["total_input_tokens"] == 20
    assert res["output_throughput"] == pytest.approx(10 / 4.0)
    assert res["request_throughput"] == pytest.approx(2 / 4.0)
    assert res["errors"] == ["", "", "HTTP 500", "timeout"]
    assert res["output_lens"] == [5, 5, 0, 0]
    assert request_samples(res, "ttft") == pytest.approx([100.0, 300.0])
    assert request_samples(res, "tpot") == pytest.approx([100.0, 100.0])


def test_percentiles_come_from_raw_samples() -> None:
    rng = np.random.default_rng(1)
    ttfts = rng.lognormal(-3, 0.5, size=501)
    recs = [ok(float(t), float(t) + 1.0, 11) for t in ttfts]
    res = compute_metrics(recs, duration=10.0, percentiles=[50, 90, 99, 99.9])
    for p, key in ((50, "p50"), (90, "p90"), (99, "p99"), (99.9, "p99.9")):
        assert res[f"{key}_ttft_ms"] == pytest.approx(float(np.percentile(ttfts * 1e3, p)))
    assert res["median_ttft_ms"] == pytest.approx(float(np.median(ttfts)) * 1e3)
    assert res["std_ttft_ms"] == pytest.approx(float(np.std(ttfts * 1e3)))


def test_goodput_counts_requests_meeting_every_slo() -> None:
    recs = [
        ok(0.05, 0.50, 10),  # ttft 50 ms, tpot 50 ms, e2el 500 ms: good
        ok(0.15, 0.50, 10),  # ttft 150 ms: misses ttft
        ok(0.05, 1.50, 10),  # tpot ~161 ms: misses tpot and e2el
        ok(0.05, 0.06, 1),  # no decode: tpot SLO cannot be missed
        failed(),
    ]
    res = compute_metrics(recs, duration=2.0, slo=SLO(ttft_ms=100, tpot_ms=100, e2el_ms=1000))
    assert res["request_goodput"] == pytest.approx(2 / 2.0)
    assert compute_metrics(recs, duration=2.0)["request_goodput"] is None


def test_empty_window_reports_zero_not_nan() -> None:
    res = compute_metrics([failed()], duration=1.0)
    assert res["completed"] == 0 and res["failed"] == 1
    assert res["mean_ttft_ms"] == 0.0 and res["output_throughput"] == 0.0


def test_answer_lengths_count_only_what_the_request_fixed() -> None:
    def asked(out: int, max_tokens: int = 8, ignore_eos: bool = True, usage: bool = True) -> RequestRecord:
        rec = ok(0.1, 0.5, out)
        rec.max_tokens, rec.ignore_eos, rec.output_from_usage = max_tokens, ignore_eos, usage
        return rec

    recs = [asked(8), asked(4), asked(12), failed(),
            asked(3, ignore_eos=False),  # the model may stop at EOS: no length was fixed
            asked(3, usage=False)]  # chunks counted: a chunk may carry several tokens
    assert compute_metrics(recs, duration=1.0)["answer_lengths"] == {"checked": 3, "short": 1, "long": 1}
