from __future__ import annotations

import numpy as np
import pytest

from infra_agent.errors import BenchmarkError
from infra_agent.judge.bootstrap import bootstrap_ratio
from infra_agent.judge.verdict import Gate, compare_runs, decide, parse_gate


def _runs(values: list[float], key: str = "output_throughput") -> list[dict]:
    return [{"ok": True, "completed": 10, key: v} for v in values]


def test_parse_gate() -> None:
    assert parse_gate("output_throughput>=0.95") == Gate("output_throughput", ">=", 0.95)
    assert parse_gate(" median_ttft_ms <= 1.1 ") == Gate("median_ttft_ms", "<=", 1.1)
    with pytest.raises(BenchmarkError):
        parse_gate("throughput is good")


def test_pass_fail_inconclusive_on_synthetic_samples() -> None:
    rng = np.random.default_rng(5)
    base = rng.normal(100, 2, size=40)
    faster = bootstrap_ratio(rng.normal(110, 2, size=40), base, stat="mean", seed=1)
    slower = bootstrap_ratio(rng.normal(80, 2, size=40), base, stat="mean", seed=1)
    assert decide(Gate("output_throughput", ">=", 1.0), faster).outcome == "pass"
    assert decide(Gate("output_throughput", ">=", 0.95), slower).outcome == "fail"
    # Lower-is-better gates read the upper end of the interval.
    assert decide(Gate("median_ttft_ms", "<=", 1.0), slower).outcome == "pass"
    assert decide(Gate("median_ttft_ms", "<=", 1.0), faster).outcome == "fail"

    # 4 noisy samples of a true 1.02x change against a 1.0 gate: cannot be decided yet.
    small = bootstrap_ratio(rng.normal(102, 8, size=4), rng.normal(100, 8, size=4), stat="mean", seed=2)
    v = decide(Gate("output_throughput", ">=", 1.0), small)
    assert v.outcome == "inconclusive"
    assert v.more_samples is not None and v.more_samples >= 1
    assert v.low is not None and v.high is not None and v.low < 1.0 < v.high


def test_more_samples_estimate_is_roughly_right() -> None:
    # With the suggested total, an interval of the same spread should decide the gate.
    rng = np.random.default_rng(9)
    true_ratio, sd, n = 1.04, 0.05, 4
    ci = bootstrap_ratio(rng.normal(true_ratio, sd, size=n), np.ones(n), stat="mean", seed=0)
    v = decide(Gate("x", ">=", 1.0), ci)
    if v.outcome != "inconclusive":
        pytest.skip("this draw happened to decide at n=4")
    total = n + (v.more_samples or 0)
    decided = 0
    for k in range(40):
        c = bootstrap_ratio(rng.normal(true_ratio, sd, size=total), np.ones(total), stat="mean", n_boot=400, seed=k)
        decided += decide(Gate("x", ">=", 1.0), c).outcome != "inconclusive"
    assert decided / 40 >= 0.3  # an estimate from n=4 is itself noisy; it should not be wildly low


def test_compare_runs_per_run_and_per_request() -> None:
    comp = compare_runs(_runs([100, 101, 99, 100]), _runs([90, 91, 89, 90]), ["output_throughput"],
                        [parse_gate("output_throughput>=0.95")])
    mc = comp.metrics[0]
    assert mc.source == "per-run" and mc.ci is not None and mc.ci.paired
    assert mc.ci.ratio == pytest.approx(0.9)
    assert comp.verdicts[0].outcome == "fail"

    # One run per side: throughput has no interval -> inconclusive, asking for runs.
    one = compare_runs(_runs([100]), _runs([90]), ["output_throughput"], [parse_gate("output_throughput>=0.95")])
    assert one.metrics[0].ci is None and one.verdicts[0].outcome == "inconclusive"
    assert "repeat" in one.verdicts[0].message

    # Latency from per-request samples of one run each.
    def run(ttfts: np.ndarray) -> dict:
        n = len(ttfts)
        return {"ok": True, "completed": n, "median_ttft_ms": float(np.median(ttfts)) * 1e3, "ttfts": list(ttfts),
                "e2els": list(ttfts + 1), "itls": [[]] * n, "output_lens": [1] * n, "errors": [""] * n}

    rng = np.random.default_rng(3)
    lat = compare_runs([run(rng.lognormal(-3, 0.3, 300))], [run(1.3 * rng.lognormal(-3, 0.3, 300))], ["median_ttft_ms"],
                       [parse_gate("median_ttft_ms<=1.05")])
    assert lat.metrics[0].source == "per-request"
    assert lat.metrics[0].ci is not None and lat.metrics[0].ci.low > 1.1
    assert lat.verdicts[0].outcome == "fail"


def test_failed_runs_are_excluded() -> None:
    a = _runs([100, 100]) + [{"ok": False, "error": "died"}]
    comp = compare_runs(a, _runs([100, 100, 100]), ["output_throughput"])
    assert comp.metrics[0].ci is not None and comp.metrics[0].ci.n_baseline == 2


def test_too_few_samples_never_decide() -> None:
    # Two pairs 20% apart: the bootstrap interval is narrow but means nothing yet.
    ci = bootstrap_ratio([80.0, 81.0], [100.0, 100.5], stat="mean", paired=True)
    v = decide(Gate("output_throughput", ">=", 0.95), ci)
    assert v.outcome == "inconclusive" and v.more_samples is not None and v.more_samples >= 1
    assert "only 2" in v.message


def test_a_failed_run_drops_its_partner_so_pairs_stay_in_their_cycles() -> None:
    # Cycle i ran A then B under the same machine load; load differs a lot by cycle.
    load = [100.0, 50.0, 200.0, 80.0]
    a = _runs(load)
    b = _runs([0.9 * x for x in load])
    a[1] = {"ok": False, "error": "died"}  # A failed in cycle 1, B failed in cycle 3
    b[3] = {"ok": False, "error": "died"}
    comp = compare_runs(a, b, ["output_throughput"])
    ci = comp.metrics[0].ci
    assert ci is not None and ci.paired and ci.n_baseline == 2
    # Pairs (cycles 0 and 2) are exactly 0.9 apart; cross-cycle pairing would not be.
    assert ci.ratio == pytest.approx(0.9)


def test_strict_gate_fails_on_an_interval_that_touches_the_threshold() -> None:
    ci = bootstrap_ratio([95.0] * 6, [100.0] * 6, stat="mean", paired=True)
    assert ci.low == pytest.approx(0.95) and ci.high == pytest.approx(0.95)
    assert decide(Gate("output_throughput", ">=", 0.95), ci).outcome == "pass"
    assert decide(Gate("output_throughput", ">", 0.95), ci).outcome == "fail"
