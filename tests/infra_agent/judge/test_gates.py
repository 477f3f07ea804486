"""Gates and hypothesis verdicts over Feedback (deterministic data, known outcomes)."""

from __future__ import annotations

from infra_agent.feedback import Feedback, Measurement, Tier
from infra_agent.judge.gates import (
    absolute_gate,
    check_gate,
    hypothesis_outcome,
    relative_gate,
    side_values,
)
from infra_agent.records import Hypothesis


def _runs(values: list[float], metric: str = "output_throughput", scenario: str = "chat") -> list[Feedback]:
    return [Feedback(probe="serving", tier=Tier.e2e,
                     measurements=[Measurement.from_samples(metric, "tok/s", [v], "higher", scenario=scenario)]) for v in values]


def test_side_values_pick_the_scenario_and_skip_failed_runs() -> None:
    runs = _runs([100, 110]) + _runs([999], scenario="other")
    runs.append(Feedback(probe="serving", tier=Tier.e2e, ok=False, error="died"))
    assert side_values(runs, "output_throughput", "chat") == [100, 110]


def test_absolute_gate_pass_fail_inconclusive() -> None:
    assert absolute_gate("g", "output_throughput", ">=", 150, "chat", _runs([240, 250, 260])).outcome == "pass"
    assert absolute_gate("g", "output_throughput", ">=", 150, "chat", _runs([70, 72, 74])).outcome == "fail"
    mid = absolute_gate("g", "output_throughput", ">=", 150, "chat", _runs([100, 160, 220]))
    assert mid.outcome == "inconclusive" and mid.more_samples
    assert mid.interval == "95% t-interval of the geometric mean over 3 run(s)"
    # One interval family at any sample size (stats/intervals.py) ...
    assert absolute_gate("g", "output_throughput", ">=", 150, "chat",
                         _runs([240 + i for i in range(12)])).interval == "95% t-interval of the geometric mean over 12 run(s)"
    # ... except for values with no logarithm (a zero), where the mean's bootstrap is labelled as such.
    zeros = absolute_gate("g", "output_throughput", "<=", 5, "chat", _runs([0, 1, 2, 1]))
    assert zeros.interval == "95% bootstrap CI of the mean over 4 run(s)" and zeros.outcome == "pass"
    missing = absolute_gate("g", "p99_ttft_ms", "<=", 100, "chat", _runs([1, 2, 3]))
    assert missing.outcome == "error" and "no run measured p99_ttft_ms" in missing.message


def test_relative_gate_is_a_paired_ratio() -> None:
    g = relative_gate("g", "output_throughput", ">=", 0.95, "chat", _runs([101, 99, 100]), _runs([100, 100, 100]))
    assert g.outcome == "pass" and g.interval == "95% t-interval of the geometric mean ratio over 3 interleaved pairs"
    g = relative_gate("g", "output_throughput", ">=", 0.95, "chat", _runs([80, 81, 79]), _runs([100, 100, 100]))
    assert g.outcome == "fail"


def test_hypothesis_supported_refuted_inconclusive() -> None:
    h = Hypothesis(statement="x", metric="output_throughput", direction="higher", min_effect=0.2, scenario="chat")
    base = _runs([100, 102, 98])
    assert hypothesis_outcome(h, _runs([150, 153, 147]), base)[0] == "supported"
    assert hypothesis_outcome(h, _runs([101, 99, 100]), base)[0] == "refuted"
    assert hypothesis_outcome(h, _runs([100, 140, 125]), base)[0] == "inconclusive"
    # A side with too few runs decides nothing.
    out, gate = hypothesis_outcome(h, _runs([150]), _runs([100]))
    assert out == "inconclusive" and gate.more_samples


def test_count_metrics_compare_exactly() -> None:
    h = Hypothesis(statement="3xtf32 restores agreement", metric="failed_checks", direction="lower", min_effect=1)
    base = [Feedback(probe="kernel", tier=Tier.check, ok=False, meta={"failed_checks": 3})]
    fixed = [Feedback(probe="kernel", tier=Tier.check, meta={"failed_checks": 0})]
    out, gate = hypothesis_outcome(h, fixed, base)
    assert out == "supported" and gate.interval == "exact count" and "3 -> candidate 0" in gate.message
    assert hypothesis_outcome(h, base, base)[0] == "refuted"


def test_check_gate_names_the_first_error() -> None:
    from infra_agent.feedback import Finding

    fb = Feedback(probe="kernel", tier=Tier.check, ok=False, error="3 failed checks",
                  findings=[Finding(kind="mismatch", severity="error", message="tp2 vs kernel under tf32")])
    g = check_gate("lm-head", fb)
    assert g.outcome == "fail" and "tp2 vs kernel under tf32" in g.message


def test_small_sample_intervals_keep_their_coverage_in_an_a_a_simulation() -> None:
    """A/A: identical configs, a per-run offset (between-run variance) and a per-pair drift.
    An interval of the ratio from 3 pairs must exclude 1.0 at most ~5% of the time."""
    import numpy as np

    rng = np.random.default_rng(7)
    trials, excluded = 400, 0
    for _ in range(trials):
        drift = rng.normal(0, 0.05, 3)
        a = 100 * np.exp(drift + rng.normal(0, 0.03, 3))
        b = 100 * np.exp(drift + rng.normal(0, 0.03, 3))
        g = relative_gate("g", "output_throughput", ">=", 1.0, "chat", _runs(list(b)), _runs(list(a)))
        assert g.low is not None and g.high is not None
        excluded += not (g.low <= 1.0 <= g.high)
    assert excluded / trials <= 0.08, excluded


def test_a_relative_criterion_on_the_baseline_alone_is_judged_at_a_ratio_of_one() -> None:
    from types import SimpleNamespace

    from infra_agent.judge.gates import criteria_gates

    def crit(name: str, op: str, ratio: float) -> SimpleNamespace:
        return SimpleNamespace(name=name, metric="output_throughput", op=op, ratio=ratio, value=None, scenario="chat")

    ws = SimpleNamespace(criteria=[crit("guard", ">=", 0.95), crit("target", ">=", 1.2), crit("cap", "<", 1.0)])
    got = {g.name: g for g in criteria_gates(ws, {"chat": _runs([100, 101, 99])}, None, "e0")}
    assert got["guard"].outcome == "skipped" and "holds by definition" in got["guard"].message
    # A target above 1 cannot hold against itself: failing, so the run works towards it.
    assert got["target"].outcome == "fail" and "does not meet >= 1.2" in got["target"].message
    assert got["cap"].outcome == "fail" and got["cap"].value == 1.0
