"""A step loop waiting on its KV transfer (``transfer_wait``) and the per-layer overlap of a
layer-wise transfer, on synthetic traces with known times (µs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infra_agent.trace.analyze import analyze
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import load_timeline
from infra_agent.vocabulary import FindingKind

from .synth import KV, MAIN, ours


def _report(tmp_path: Path, spans: list[Any]) -> Any:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(ours(spans)))
    return analyze(load_timeline([path]))


def _request_granular() -> list[Any]:
    """Two prefill steps of 10 ms: 6 ms of compute, then 0.5 ms packing and 3.5 ms waiting for the link."""
    spans: list[Any] = []
    for k in range(2):
        t = k * 10_000
        spans += [("engine.step", "engine", MAIN, t, t + 10_000, None), ("prefill", "engine", MAIN, t, t + 6000, None),
                  ("kv.put_bulk", "kv", MAIN, t + 6000, t + 6500, {"request_id": f"r{k}"}),
                  ("kv.wait", "kv", MAIN, t + 6500, t + 10_000, {"request_id": f"r{k}"}),
                  ("kv.send", "kv", KV, t + 6500, t + 10_000, {"request_id": f"r{k}", "layer": -1})]
    return spans


def test_a_step_that_waits_for_its_transfer_is_named(tmp_path: Path) -> None:
    report = _report(tmp_path, _request_granular())
    (w,) = report.transfer_waits
    assert (w.thread, w.steps, w.requests, w.layered) == ("MainThread", 2, 2, False)
    assert abs(w.share - 0.4) < 1e-9 and w.top == "kv.wait"
    fb = timeline_feedback(report, knob_hints={"kv.wait": "kv_transfer_granularity"})
    (f,) = [f for f in fb.findings if f.kind == FindingKind.TRANSFER_WAIT]
    assert f.location is not None and (f.location.component, f.location.span, f.location.knob) == (
        "kv_transfer", "kv.wait", "kv_transfer_granularity")
    assert "40% of its 2 steps" in f.message and "kv.wait 35%" in f.message and "after the whole prefill" in f.message
    assert "layer" in (f.next_question or "")
    share = [m for m in fb.measurements if m.name == "transfer_wait_share"]
    assert share and abs(share[0].samples[0] - 0.4) < 1e-9
    # A request-granular send names no layer: the per-layer overlap has nothing to report.
    assert report.overlap.layers == []


def test_layer_wise_sends_overlap_the_later_layers_and_leave_a_short_wait(tmp_path: Path) -> None:
    # One 8 ms step over 4 layers of 1.5 ms (then 2 ms of head); each layer's send (1 ms on the
    # link thread) starts when its layer ends; the step waits 0.5 ms for the last one.
    spans: list[Any] = [("engine.step", "engine", MAIN, 0, 8000, None), ("prefill", "engine", MAIN, 0, 7500, None)]
    for i in range(4):
        spans.append(("attention" if i % 2 else "kda", "attn" if i % 2 else "kda", MAIN, 1500 * i, 1500 * (i + 1),
                      {"layer": i}))
        spans.append(("kv.send", "kv", KV, 1500 * (i + 1), 1500 * (i + 1) + 1000, {"request_id": "r", "layer": i}))
    spans.append(("kv.wait", "kv", MAIN, 7500, 8000, {"request_id": "r"}))
    report = _report(tmp_path, spans)
    layers = {lo.layer: lo for lo in report.overlap.layers}
    assert [round(layers[i].share, 6) for i in range(4)] == [1.0, 1.0, 1.0, 0.0]
    assert layers[0].threads == ["kv-transfer"] and layers[3].transfer_us == 1000
    (w,) = report.transfer_waits
    assert w.layered and abs(w.share - 500 / 8000) < 1e-9
    fb = timeline_feedback(report)
    assert not [f for f in fb.findings if f.kind == FindingKind.TRANSFER_WAIT]  # 6% of the step: under the bar
    shares = {m.tags["interval"]: m.samples[0] for m in fb.measurements if m.name == "layer_overlap_share"}
    assert shares == {"layer 0": 1.0, "layer 1": 1.0, "layer 2": 1.0, "layer 3": 0.0}
