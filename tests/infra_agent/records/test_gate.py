"""Gates as data: the one gate-text parser, and the spec every GateResult carries."""

from __future__ import annotations

from infra_agent.records import GateResult, GateSpec, Hypothesis, parse_gate_text


# Moved from tests/infra_agent/agent/test_search.py (the search proposer's parser is gone:
# it reads GateResult.spec).
def test_parse_gate() -> None:
    parse_gate = parse_gate_text
    assert parse_gate("output_throughput>=300 @chat") == parse_gate("output_throughput >= 300  @ chat")
    g = parse_gate("p99_ttft_ms<=1.1 @short-chat")
    assert g is not None and (g.metric, g.op, g.threshold, g.scenario) == ("p99_ttft_ms", "<=", 1.1, "short-chat")
    g = parse_gate("output_throughput>=1e+06 @long-prefill")
    assert g is not None and g.threshold == 1e6
    assert parse_gate("check lm-head-tp") is None
    # Relative gates, as the judge labels them.
    g = parse_gate("p99_ttft_ms<=1.1 @short-chat x baseline")
    assert g is not None and (g.metric, g.threshold, g.scenario) == ("p99_ttft_ms", 1.1, "short-chat")
    assert g.kind == "relative"


def test_a_record_without_a_spec_gets_one_when_loaded() -> None:
    """Ledgers written before gates carried a spec still load, with the spec read from the label."""
    old = '{"name":"tput","gate":"output_throughput>=300 @chat","kind":"absolute","outcome":"fail"}'
    g = GateResult.model_validate_json(old)
    assert g.spec == GateSpec(kind="absolute", metric="output_throughput", op=">=", threshold=300, scenario="chat")
    check = GateResult(name="kv", gate="check kv (kv_transfer/e2e): kv_ratio>=0.95", kind="check", outcome="pass")
    assert check.spec is not None and (check.spec.check, check.spec.metric, check.spec.threshold) == ("kv", "kv_ratio", 0.95)
    count = GateResult(name="hypothesis", gate="failed_checks <= baseline - 1", kind="hypothesis", outcome="pass")
    assert count.spec is not None and (count.spec.metric, count.spec.op, count.spec.threshold) == ("failed_checks", "<=", 1)
    assert GateResult(name="c", gate="check lm-head-tp", kind="check", outcome="fail").spec is None


def test_a_given_spec_is_kept_and_round_trips() -> None:
    spec = GateSpec(kind="hypothesis", metric="lat=ms", op=">=", threshold=1.1)
    g = GateResult(name="hypothesis", gate="lat=ms>=1.1", kind="hypothesis", outcome="pass", spec=spec)
    assert GateResult.model_validate_json(g.model_dump_json()).spec == spec


def test_hypothesis_spec_matches_its_text() -> None:
    h = Hypothesis(statement="s", metric="p99_ttft_ms", direction="lower", min_effect=0.1, scenario="chat")
    spec = h.gate_spec()
    assert (spec.op, spec.threshold, spec.scenario) == ("<=", float(f"{1 / 1.1:.6g}"), "chat")
    assert parse_gate_text(h.gate_text(), "hypothesis") == spec.model_copy(update={"scenario": None})
    count = Hypothesis(statement="s", metric="failed_checks", direction="lower", min_effect=1)
    assert parse_gate_text(count.gate_text()) == count.gate_spec()
