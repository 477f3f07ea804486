from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier


def test_round_trip_and_text_rendering():
    m = Measurement.from_samples("ttft", "ms", [10.0, 12.0, 11.0, 13.0], better="lower", component="prefill", knob="max_batch_tokens")
    assert m.summary is not None and m.summary.median == pytest.approx(11.5)
    assert m.summary.ci_low < m.summary.mean < m.summary.ci_high
    fb = Feedback(
        probe="serving",
        tier=Tier.e2e,
        scope=["engine"],
        measurements=[m],
        findings=[
            Finding(
                kind="regression",
                message="prefill time rose",
                location=Location(file="engine.py", line=42, component="prefill"),
                evidence={"ratio": 1.21},
                next_question="does chunk size change it?",
            )
        ],
    )
    again = Feedback.from_json(fb.to_json())
    assert again == fb
    text = fb.render_text()
    assert "ttft[ms]" in text and "engine.py:42" in text and "next: does chunk size" in text
    assert fb.measurement("ttft", component="prefill") is fb.measurements[0]


def test_unknown_locality_tag_is_rejected():
    with pytest.raises(ValidationError, match="unknown locality tag"):
        Measurement.from_samples("x", "s", [1.0], colour="red")


def test_tier_order():
    assert Tier.check.rank < Tier.micro.rank < Tier.trace.rank < Tier.e2e.rank
