"""An experiment's two sides (tools/sides.py): metrics side by side, labelled findings, and a text
that never drops a side, however much one side has to say."""

from __future__ import annotations

import pytest

from infra_agent.agent.proposers.llm_prompt import experiment_result
from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Location,
    Measurement,
    Tier,
)
from infra_agent.records import Experiment, Hypothesis, Verdict
from infra_agent.tools.sides import (
    fit,
    keep_head,
    labelled_findings,
    metric_rows,
    sides_data,
    sides_text,
)


def _side(tput: list[float], ttft: list[float], findings: list[Finding], *, extra: bool = False) -> Feedback:
    ms = [Measurement.from_samples("ttft_ms", "ms", ttft, "lower", scenario="chat"),
          Measurement.from_samples("output_throughput", "tok/s", tput, "higher", scenario="chat")]
    if extra:
        ms.append(Measurement.from_samples("kv_pages", "pages", [4.0], None, scenario="chat"))
    return Feedback(probe="serving", tier=Tier.e2e, measurements=ms, findings=findings,
                    artifacts=[Artifact(kind="log", path="/x/server.log"), Artifact(kind="log", path="/x/server.log"),
                               Artifact(kind="trace", path="/x/spans-chat.json")])


def _experiment(candidate_findings: int = 1) -> Experiment:
    base = _side([100.0, 102.0, 98.0], [50.0, 52.0], [Finding(
        kind="queue_dominates_ttft", severity="warning", message="baseline requests wait 40 ms of a 50 ms TTFT",
        location=Location(component="engine.scheduler"), evidence={"queue_share": 0.8})])
    cand = _side([150.0, 149.0, 151.0], [30.0, 31.0], [Finding(
        kind="span_trend", severity="info" if i else "warning", message=f"candidate finding {i} " + "x" * 120,
        evidence={"n": i}) for i in range(candidate_findings)], extra=True)
    return Experiment(id="e2", run_id="r", seq=2, parent="e1", status="done", feedback=cand, baseline_feedback=base,
                      hypothesis=Hypothesis(statement="more running", metric="output_throughput", direction="higher"),
                      verdict=Verdict(outcome="supported", effect=1.5, low=1.4, high=1.6, accepted=True))


def test_each_metric_is_one_row_with_both_sides() -> None:
    rows = metric_rows(_experiment())
    assert [r["name"] for r in rows] == ["output_throughput", "ttft_ms", "kv_pages"]  # the hypothesis metric first
    tput = rows[0]
    assert tput["baseline"]["median"] == 100.0 and tput["candidate"]["median"] == 150.0
    assert tput["ratio"] == pytest.approx(1.5) and tput["better"] == "higher" and tput["tags"] == {"scenario": "chat"}
    assert tput["baseline"]["n"] == 3 and tput["baseline"]["ci_low"] <= 100.0 <= tput["baseline"]["ci_high"]
    only = rows[2]
    assert only["baseline"] is None and only["candidate"]["median"] == 4.0 and only["ratio"] is None


def test_findings_and_files_are_labelled_by_side() -> None:
    e = _experiment(candidate_findings=2)
    found = labelled_findings(e)
    assert [f["side"] for f in found] == ["baseline", "candidate", "candidate"]
    assert found[0]["message"].startswith("baseline requests wait")
    data = sides_data(e)
    assert data["sides"]["baseline"]["experiment"] == "e1" and data["sides"]["candidate"]["experiment"] == "e2"
    assert data["sides"]["candidate"]["findings"] == 2
    assert [a["path"] for a in data["sides"]["baseline"]["artifacts"]] == ["/x/server.log", "/x/spans-chat.json"]


def test_a_long_side_never_pushes_the_other_out_of_the_text() -> None:
    e = _experiment(candidate_findings=300)  # tens of thousands of characters on the candidate's side
    for limit in (1500, 4000, 8000):
        text = sides_text(e, limit)
        assert len(text) <= limit + 100, (limit, len(text))
        assert "output_throughput[tok/s] scenario=chat: 100 -> 150 (x1.5, higher is better)" in text
        assert "baseline (e1)" in text and "baseline requests wait 40 ms" in text
        assert "candidate (e2)" in text and "candidate finding 0" in text and "more lines cut" in text


def test_the_run_experiment_text_keeps_the_baseline() -> None:
    e = _experiment(candidate_findings=300)
    text = experiment_result(e, 6000)
    assert len(text) <= 6100 and "verdict: SUPPORTED" in text
    assert "baseline requests wait 40 ms" in text and "100 -> 150" in text and "candidate finding 0" in text
    assert "characters (" not in text  # no cut in the middle of the whole


def test_fit_gives_short_parts_all_and_long_ones_the_rest() -> None:
    short, long_a, long_b = "a" * 100, "\n".join(["b" * 50] * 100), "\n".join(["c" * 50] * 100)
    out = fit([long_a, short, long_b], 2100)
    assert out[1] == short
    assert 800 < len(out[0]) <= 1000 and 800 < len(out[2]) <= 1000
    assert keep_head("x" * 5000, 300).endswith("characters cut]") and len(keep_head("x" * 5000, 300)) <= 300


def test_the_changed_sides_knob_tag_does_not_split_a_metric() -> None:
    # The serving probe tags the candidate's measurements with the knob it changed.
    e = _experiment()
    assert e.feedback is not None
    for m in e.feedback.measurements:
        m.tags["knob"] = "max_running=4"
    rows = metric_rows(e)
    tput = rows[0]
    assert [r["name"] for r in rows] == ["output_throughput", "ttft_ms", "kv_pages"]
    assert tput["tags"] == {"scenario": "chat"} and tput["ratio"] == pytest.approx(1.5)
    assert tput["candidate"]["knob"] == "max_running=4" and "knob" not in tput["baseline"]
    # Two arms of one knob on one side (a timeline comparison) stay two rows, not one guess.
    arms = [Measurement.from_samples("ratio", "x", [v], None, knob=f"ep={v}") for v in (1.0, 2.0)]
    assert e.baseline_feedback is not None
    e.baseline_feedback.measurements += arms
    e.feedback.measurements.append(Measurement.from_samples("ratio", "x", [3.0], None, knob="ep=3"))
    assert [(r["baseline"] or {}).get("median") for r in metric_rows(e) if r["name"] == "ratio"] == [1.0, 2.0, None]
