from __future__ import annotations

import infra_agent.tracing.recorder as rec
from infra_agent.tracing.recorder import Tracer
from refstack.model import HybridConfig, HybridModel, SeqChunk


def test_forward_emits_the_documented_spans(monkeypatch) -> None:
    model = HybridModel(HybridConfig.preset("tiny"))
    cache = model.new_cache(num_slots=2)
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    model.forward_chunks([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4], 0)], cache)
    spans = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"]
    cats = {(e["name"], e["cat"]) for e in spans}
    for expected in [
        ("model.forward", "model"),
        ("kda", "kda"),
        ("attention", "attn"),
        ("moe.dispatch", "moe"),
        ("moe.experts", "moe"),
        ("moe.combine", "moe"),
        ("lm_head", "lm_head"),
    ]:
        assert expected in cats, expected
    forward = next(e for e in spans if e["name"] == "model.forward")
    assert forward["args"]["num_chunks"] == 2 and forward["args"]["tokens"] == 4
    cfg = model.config
    assert sum(e["name"] == "kda" for e in spans) == len(cfg.kda_layers)
    assert sum(e["name"] == "moe.experts" for e in spans) == cfg.num_layers
    # Every span lies inside the forward span.
    end = forward["ts"] + forward["dur"] + 1e-3
    assert all(forward["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end for e in spans)


def test_no_spans_when_tracing_is_off(monkeypatch) -> None:
    model = HybridModel(HybridConfig.preset("tiny"))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=False))
    model.forward_chunks([SeqChunk(0, [1, 2], 0)], model.new_cache(num_slots=1))
    assert [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"] == []
