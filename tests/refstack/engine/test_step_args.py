"""Engine spans carry the step's shape: batch, tokens, context, generated."""

from __future__ import annotations

import pytest

import infra_agent.tracing.recorder as rec
from infra_agent.tracing.recorder import Tracer
from refstack.engine import Engine, EngineConfig, SamplingParams


def test_step_spans_carry_the_batch_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(EngineConfig(preset="tiny", max_running=4, cpu_kernels="torch", dtype="float32"))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    engine.generate([[1] * 10, [2] * 6], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    spans = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X" and e["cat"] == "engine"]
    prefill = next(e for e in spans if e["name"] == "prefill")
    assert prefill["args"] == {"chunks": 2, "batch": 2, "tokens": 16, "context": 16, "generated": 0}
    decodes = [e for e in spans if e["name"] == "decode"]
    # First decode: the two sequences feed their first token at positions 10 and 6.
    assert decodes[0]["args"] == {"batch": 2, "tokens": 2, "context": 11 + 7, "generated": 2}
    assert decodes[1]["args"] == {"batch": 2, "tokens": 2, "context": 12 + 8, "generated": 4}
    steps = [e for e in spans if e["name"] == "engine.step"]
    assert steps[0]["args"] == {"batch": 2, "tokens": 16, "context": 16, "generated": 0}
