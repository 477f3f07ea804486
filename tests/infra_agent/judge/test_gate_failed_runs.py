"""A run that measured and then failed only its own gate (a check's ``min_ratio``) still
counts for a hypothesis about what it measured; a run that failed to measure does not
(case study B: the baseline's check fails on the ratio, and the experiment's hypothesis is
about the throughput both sides' checks measured)."""

from __future__ import annotations

from infra_agent.feedback import Feedback, Measurement, Tier
from infra_agent.judge.gates import check_gate, hypothesis_outcome, side_values
from infra_agent.records import Hypothesis


def _check(values: list[float], ok: bool = True, gate_failed: bool = False) -> Feedback:
    fb = Feedback(probe="timeline", tier=Tier.trace, ok=ok, error=None if ok else "kv_transfer_prefill_ratio 0.90 < 0.95",
                  measurements=[Measurement.from_samples("total_token_throughput", "tok/s", values, "higher",
                                                         scenario="prefill")])
    if gate_failed:
        fb.meta["gate_failed"] = "kv_transfer_prefill_ratio"
    return fb


def test_a_gate_failure_keeps_the_measurements_and_still_fails_the_check() -> None:
    failed = _check([100.0, 104.0, 98.0], ok=False, gate_failed=True)
    assert side_values([failed], "total_token_throughput", "prefill") == [100.0, 104.0, 98.0]
    assert check_gate("kv-transfer-prefill-ratio", failed).outcome == "fail"
    # a run that failed for any other reason is still left out
    assert side_values([_check([100.0], ok=False)], "total_token_throughput", "prefill") == []


def test_a_hypothesis_is_judged_against_a_baseline_whose_check_failed_its_ratio() -> None:
    h = Hypothesis(statement="release the GIL", metric="total_token_throughput", direction="higher",
                   min_effect=0.05, scenario="prefill")
    baseline = [_check([100.0, 104.0, 98.0], ok=False, gate_failed=True)]
    candidate = [_check([130.0, 133.0, 128.0])]
    outcome, gate = hypothesis_outcome(h, candidate, baseline)
    assert outcome == "supported", gate.message
    outcome, _ = hypothesis_outcome(h, candidate, [_check([100.0, 104.0, 98.0], ok=False)])
    assert outcome == "inconclusive"
