from __future__ import annotations

import math

import numpy as np
import pytest

from infra_agent.errors import BenchmarkError
from infra_agent.judge.verdict import (
    PER_REQUEST_LABEL,
    Gate,
    compare_runs,
    decide,
    parse_gate,
    workload_mismatch,
)
from infra_agent.stats.bootstrap import bootstrap_ratio


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


def _spread(n: int, mean: float, sd: float) -> np.ndarray:
    """n values with exactly this mean and sample sd, shaped like a normal sample (no draw)."""
    from scipy import stats

    z = stats.norm.ppf((np.arange(n) + 0.5) / n)
    return mean + sd * z / z.std(ddof=1)


def test_more_samples_estimate_is_roughly_right() -> None:
    # Constructed, not drawn: 4 samples of a true 1.04 ratio with sd 0.05 against a 1.0
    # gate straddle it; the same spread at the suggested total (about) decides it.
    gate = Gate("x", ">=", 1.0)
    n = 4
    v = decide(gate, bootstrap_ratio(_spread(n, 1.04, 0.05), np.ones(n), stat="mean", seed=0))
    assert v.outcome == "inconclusive"
    assert v.more_samples is not None and 2 <= v.more_samples <= 10
    total = n + v.more_samples

    def outcome(m: int) -> str:
        return decide(gate, bootstrap_ratio(_spread(m, 1.04, 0.05), np.ones(m), stat="mean", seed=0)).outcome

    # Neither wildly low (a quarter more samples than suggested decide it) nor wildly
    # high (half of them do not).
    assert outcome(math.ceil(1.25 * total)) == "pass"
    assert outcome(max(n, total // 2)) == "inconclusive"


def test_compare_runs_per_run_and_per_request() -> None:
    comp = compare_runs(_runs([100, 101, 99, 100]), _runs([90, 91, 89, 90]), ["output_throughput"],
                        [parse_gate("output_throughput>=0.95")])
    mc = comp.metrics[0]
    assert mc.source == "per-run" and mc.ci is not None and mc.ci.paired
    # The judge's one family: the geometric mean of the per-pair ratios, t-interval on their logs.
    per_pair = np.log(np.array([90, 91, 89, 90]) / np.array([100, 101, 99, 100]))
    assert mc.ci.stat == "geomean" and mc.ci.ratio == pytest.approx(float(np.exp(per_pair.mean())), rel=1e-12)
    assert "per-pair ratios, t-interval" in mc.note
    assert comp.verdicts[0].outcome == "fail"
    # The bootstrap of the ratio of means is there when asked for, and says so.
    boot = compare_runs(_runs([100, 101, 99, 100]), _runs([90, 91, 89, 90]), ["output_throughput"], interval="bootstrap")
    assert boot.metrics[0].ci is not None and boot.metrics[0].ci.ratio == pytest.approx(0.9)
    assert boot.metrics[0].note.startswith("bootstrap of the mean")

    # One run per side: throughput has no interval -> inconclusive, asking for runs.
    one = compare_runs(_runs([100]), _runs([90]), ["output_throughput"], [parse_gate("output_throughput>=0.95")])
    assert one.metrics[0].ci is None and one.verdicts[0].outcome == "inconclusive"
    assert "repeat" in one.verdicts[0].message

    # Latency of one run each: by default no interval either (the requests of one run
    # cannot show the spread between runs) ...
    rng = np.random.default_rng(3)
    a, b = [_ttft_run(rng.lognormal(-3, 0.3, 300))], [_ttft_run(1.3 * rng.lognormal(-3, 0.3, 300))]
    gate = parse_gate("median_ttft_ms<=1.05")
    lat = compare_runs(a, b, ["median_ttft_ms"], [gate])
    assert lat.metrics[0].source == "none" and lat.metrics[0].ci is None
    assert lat.metrics[0].ratio == pytest.approx(lat.metrics[0].candidate / lat.metrics[0].baseline)
    v = lat.verdicts[0]
    assert v.outcome == "inconclusive" and v.more_samples == 2
    assert "repeat the runs interleaved" in v.message and ">= 3" in v.message

    # The per-request bootstrap, when asked for, gives an interval and says what it ignores;
    # it still decides nothing: the requests of one run are not independent samples of the
    # server, so the runs stay the unit of the verdict.
    lat = compare_runs(a, b, ["median_ttft_ms"], [gate], per_request=True)
    assert lat.metrics[0].source == "per-request"
    assert lat.metrics[0].ci is not None and lat.metrics[0].ci.low > 1.1
    v = lat.verdicts[0]
    assert v.outcome == "inconclusive" and v.more_samples == 2 and v.low is not None and v.low > 1.1
    assert "describes these two runs only" in v.message and "repeat the runs interleaved" in v.message
    assert PER_REQUEST_LABEL in v.message and PER_REQUEST_LABEL in lat.metrics[0].note


def _ttft_run(ttfts: np.ndarray) -> dict:
    n = len(ttfts)
    return {"ok": True, "completed": n, "median_ttft_ms": float(np.median(ttfts)) * 1e3, "ttfts": list(ttfts),
            "e2els": list(ttfts + 1), "itls": [[]] * n, "output_lens": [1] * n, "errors": [""] * n}


def test_single_runs_of_identical_configs_do_not_decide() -> None:
    # A/A calibration: 40 pairs of single runs whose requests come from one distribution,
    # each run shifted by its own offset (what differs between two runs of the same
    # configuration: the process, the machine's load in that minute).
    rng = np.random.default_rng(11)
    gates = [parse_gate("median_ttft_ms<=0.9"), parse_gate("median_ttft_ms>=1.1")]

    def one_run() -> dict:
        return _ttft_run(np.exp(rng.normal(-3 + rng.normal(0, 0.08), 0.3, 200)))

    pairs = [([one_run()], [one_run()]) for _ in range(40)]
    false_default = false_per_request = decided_per_request = 0
    for i, (a, b) in enumerate(pairs):
        default = compare_runs(a, b, ["median_ttft_ms"], gates, n_boot=1000, seed=i)
        ci = default.metrics[0].ci
        false_default += any(v.outcome == "pass" for v in default.verdicts) or (ci is not None and not ci.low <= 1.0 <= ci.high)
        per_req_comp = compare_runs(a, b, ["median_ttft_ms"], gates, n_boot=1000, seed=i, per_request=True)
        per_req = per_req_comp.metrics[0].ci
        assert per_req is not None
        false_per_request += not per_req.low <= 1.0 <= per_req.high
        decided_per_request += any(v.outcome != "inconclusive" for v in per_req_comp.verdicts)
    assert false_default / len(pairs) <= 0.05
    assert decided_per_request == 0  # --per-request shows its interval but never decides an A/A pair
    # Why the default refuses: the per-request intervals ignore the runs' offsets and
    # exclude 1.0 far more often than 5% of the time.
    assert false_per_request / len(pairs) > 0.25


def test_a_failed_side_is_reported_as_failed() -> None:
    good = _runs([100, 101, 99])
    dead = [{"ok": False, "error": "server exited with code 1"}] * 3
    gate = parse_gate("output_throughput>=0.95")
    b_failed = compare_runs(good, dead, ["output_throughput"], [gate])
    assert b_failed.failed == {"B": "none of its 3 runs succeeded; the first failed with: server exited with code 1"}
    assert b_failed.verdicts[0].outcome == "fail"
    assert b_failed.verdicts[0].message.startswith("B (candidate) failed: ")
    assert b_failed.metrics[0].baseline == pytest.approx(100) and b_failed.metrics[0].candidate is None

    a_failed = compare_runs(dead[:1], _runs([100]), ["output_throughput"], [gate])
    assert set(a_failed.failed) == {"A"}
    assert a_failed.verdicts[0].outcome == "inconclusive"
    assert a_failed.verdicts[0].message == "A (baseline) failed: its only run failed with: server exited with code 1"

    # A run that completed no request failed too, with its first request error.
    empty = [{"ok": True, "completed": 0, "output_throughput": 0.0, "errors": ["", "HTTP 500: boom"]}]
    comp = compare_runs(good[:1], empty, ["output_throughput"], [gate])
    assert comp.failed == {"B": "its only run completed no request (first error: HTTP 500: boom)"}


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"confidence": 1.5}, "confidence: expected a number between 0 and 1"),
    ({"confidence": 0.0}, "confidence: expected a number between 0 and 1"),
    ({"n_boot": 0}, "n_boot: expected at least 100"),
    ({"process_noise": -0.1}, "process_noise: expected a finite number >= 0"),
])
def test_unusable_options_are_refused(kwargs: dict, fragment: str) -> None:
    with pytest.raises(BenchmarkError, match=fragment):
        compare_runs(_runs([100, 101, 99]), _runs([100, 101, 99]), ["output_throughput"], **kwargs)


@pytest.mark.parametrize(("run", "fragment"), [
    ({"ok": True, "completed": "many", "output_throughput": 1.0}, "completed is 'many'"),
    ({"ok": "yes", "completed": 3, "output_throughput": 1.0}, "ok is 'yes'"),
    ({"ok": True, "completed": 3, "output_throughput": "fast"}, "output_throughput is 'fast'"),
    ({"ok": True, "completed": 3, "output_throughputt": 1.0}, "did you mean output_throughputt"),
])
def test_malformed_runs_are_refused_by_name(run: dict, fragment: str) -> None:
    with pytest.raises(BenchmarkError, match=fragment) as info:
        compare_runs(_runs([100, 101, 99]), [run] * 3, ["output_throughput"])
    assert "B (candidate) run 0" in str(info.value)


def test_workload_mismatch_names_each_field_with_both_values() -> None:
    header = {"ok": True, "completed": 4, "model_id": "m", "endpoint": "completions", "num_prompts": 16,
              "max_concurrency": 4, "request_rate": "inf", "burstiness": 1.0,
              "dataset": {"kind": "random", "input_len": 64, "output_len": 32, "range_ratio": 0.0, "seed": 0}}
    same = [dict(header), dict(header)]
    assert workload_mismatch(same, [dict(header)]) == []
    # a failed run carries no workload and is not compared
    assert workload_mismatch(same + [{"ok": False, "error": "died"}], same) == []

    other = {**header, "num_prompts": 32, "max_concurrency": None, "request_rate": 8.0, "model_id": "m2",
             "dataset": {**header["dataset"], "output_len": 16, "seed": 1}}
    assert workload_mismatch(same, [other]) == [
        'model_id: A "m", B "m2"', "num_prompts: A 16, B 32", "max_concurrency: A 4, B null",
        'request_rate: A "inf", B 8.0', "dataset.output_len: A 32, B 16", "dataset.seed: A 0, B 1",
    ]
    # an infinite rate written as a float is the same as "inf"; a field one side lacks differs
    assert workload_mismatch([{**header, "request_rate": float("inf")}], same) == []
    no_seed = {**header, "dataset": {k: v for k, v in header["dataset"].items() if k != "seed"}}
    assert workload_mismatch(same, [no_seed]) == ["dataset.seed: A 0, B (absent)"]
    # runs of one side that differ among themselves are a mismatch too
    assert workload_mismatch([header, {**header, "num_prompts": 8}], same) == [
        "num_prompts: A 16 or 8 (differs between A's runs), B 16"]
    # results without a header (hand-made, other tools) have nothing to compare
    assert workload_mismatch(_runs([1.0]), _runs([2.0])) == []


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
