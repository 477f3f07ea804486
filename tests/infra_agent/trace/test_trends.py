"""Span trends, per-step shares and per-position latency on constructed data."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.trace.analyze import analyze
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import load_timeline
from infra_agent.trace.trends import position_latency, span_trends, step_shares
from infra_agent.vocabulary import FindingKind

from .synth import MAIN, ours, write


def _steps(n: int = 40) -> list:
    spans = []
    t = 0.0
    for i in range(n):
        sample_us = 100 + 10 * i  # grows 10 µs per generated token
        spans += [("engine.step", "engine", MAIN, t, t + 1000 + sample_us, None),
                  ("schedule", "engine", MAIN, t, t + 100, None),
                  ("model.forward", "model", MAIN, t + 100, t + 1000, {"tokens": 4}),
                  ("sample", "engine", MAIN, t + 1000, t + 1000 + sample_us, {"batch": 2, "generated": i})]
        t += 2000 + sample_us
    return spans


def test_span_trend_slope_in_units(tmp_path: Path) -> None:
    tl = load_timeline([write(tmp_path / "t.json", ours(_steps()))])
    trends = {t.name: t for t in span_trends(tl.spans)}
    sample = trends["sample"]
    assert sample.rising and trends["model.forward"].flat
    gen = next(f for f in sample.fits if f.regressor == "generated")
    assert gen.slope == pytest.approx(10.0) and gen.unit == "µs per generated" and gen.r2 == pytest.approx(1.0)
    per_row = next(f for f in sample.fits if f.regressor == "generated per row")
    assert per_row.slope == pytest.approx(5.0) and per_row.unit == "µs per generated per row"
    fb = timeline_feedback(analyze(tl))
    f = next(f for f in fb.findings if f.kind == FindingKind.SPAN_TREND)
    assert f.message.startswith("span sample: mean ") and "while model.forward stayed flat" in f.message


def test_step_shares(tmp_path: Path) -> None:
    tl = load_timeline([write(tmp_path / "t.json", ours(_steps(2)))])
    ss = step_shares(tl.spans)
    assert ss is not None
    # steps: 1100 + 1110 µs; model 900 each; schedule 100 each; sample 100 + 110
    assert (ss.steps, ss.step_us, ss.model_us) == (2, 2210, 1800)
    assert ss.by_name == {"sample": 210, "schedule": 200} and ss.untraced_us == 0
    assert ss.non_model_share == pytest.approx(410 / 2210)


def test_step_overhead_finding(tmp_path: Path) -> None:
    spans = [("engine.step", "engine", MAIN, 0, 1000, None), ("decode", "engine", MAIN, 0, 500, None),
             ("sample", "engine", MAIN, 500, 900, None)]
    fb = timeline_feedback(analyze(load_timeline([write(tmp_path / "t.json", ours(spans))])))
    f = next(f for f in fb.findings if f.kind == FindingKind.STEP_OVERHEAD)
    assert "non-model work took 50%" in f.message and "sample 40%" in f.message
    assert f.location is not None and f.location.span == "sample"


def test_position_latency_rising_and_flat() -> None:
    rising = {"itls": [[0.010 + 0.0005 * k for k in range(50)] for _ in range(4)]}
    pl = position_latency(rising)
    assert pl is not None and pl.rising and pl.fit is not None
    assert pl.fit.slope == pytest.approx(0.5) and pl.fit.unit == "ms per output position"
    flat = position_latency([{"itl": [0.01] * 30 + [0.0101] * 20, "success": True}])
    assert flat is not None and not flat.rising
    assert position_latency({"itls": []}) is None


def test_position_finding_in_feedback(tmp_path: Path) -> None:
    tl = load_timeline([write(tmp_path / "t.json", ours([("a", "x", MAIN, 0, 10, None)]))])
    fb = timeline_feedback(analyze(tl), serving_result={"itls": [[0.010 + 0.0005 * k for k in range(50)]] * 3})
    f = next(f for f in fb.findings if f.kind == FindingKind.LATENCY_RISES_WITH_POSITION)
    assert "slope 500 µs per position" in f.message
