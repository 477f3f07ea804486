from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier


def test_round_trip_and_text_rendering():
    m = Measurement.from_samples("ttft", "ms", [10.0, 12.0, 11.0, 13.0], better="lower", component="engine", knob="max_batch_tokens")
    assert m.summary is not None and m.summary.median == pytest.approx(11.5)
    # The interval is the bootstrap interval of the median, and says so.
    assert m.summary.ci_stat == "median" and m.summary.ci_low <= m.summary.median <= m.summary.ci_high
    assert 10.0 <= m.summary.ci_low and m.summary.ci_high <= 13.0
    fb = Feedback(
        probe="serving",
        tier=Tier.e2e,
        scope=["engine"],
        measurements=[m],
        findings=[
            Finding(
                kind="regression",
                message="prefill time rose",
                location=Location(file="engine.py", line=42, component="model.attention", span="prefill"),
                evidence={"ratio": 1.21},
                next_question="does chunk size change it?",
            )
        ],
    )
    again = Feedback.from_json(fb.to_json())
    assert again == fb
    text = fb.render_text()
    assert "ttft[ms]" in text and "engine.py:42" in text and "next: does chunk size" in text
    assert "ci95(median)=" in text and "span=prefill" in text
    assert fb.measurement("ttft", component="engine") is fb.measurements[0]


def test_location_components_come_from_the_vocabulary():
    assert Location(component="engine.scheduler").component == "engine.scheduler"
    assert Location(component="model.rope").component == "model.rope"  # free below a known top level
    with pytest.raises(ValidationError, match="did you mean 'engine'"):
        Location(component="engin")
    with pytest.raises(ValidationError, match="expected a component"):
        Location(component="variant=tp2")
    loc = Location(kernel="lm_head", variant="tp2", precision="tf32")
    assert str(loc) == "kernel=lm_head variant=tp2 precision=tf32"


def test_unknown_locality_tag_is_rejected():
    with pytest.raises(ValidationError, match="unknown locality tag"):
        Measurement.from_samples("x", "s", [1.0], colour="red")


def test_tier_order():
    assert Tier.check.rank < Tier.micro.rank < Tier.trace.rank < Tier.e2e.rank
