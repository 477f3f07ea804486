"""Engine spans carry the step's shape: batch, tokens, context, generated."""

from __future__ import annotations

import itertools

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


def test_the_step_times_its_own_phases_nested_in_order_and_a_failed_step_keeps_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's four spans are timed by the engine and recorded in one call: each phase
    lies inside its step, in order; a step whose forward raises still records its schedule
    phase and its own extent; the step level records them, a level without "engine" not."""
    engine = Engine(EngineConfig(preset="tiny", max_running=2, cpu_kernels="torch", dtype="float32"))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True, level="step"))
    engine.generate([[1] * 5], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    spans = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X" and e["cat"] == "engine"]
    steps = sorted((e for e in spans if e["name"] == "engine.step"), key=lambda e: e["ts"])
    assert len(steps) == 3  # a prefill and two decodes
    for step in steps:
        inside = sorted((e for e in spans if e["name"] != "engine.step" and step["ts"] <= e["ts"]
                         and e["ts"] + e["dur"] <= step["ts"] + step["dur"]), key=lambda e: e["ts"])
        assert [e["name"] for e in inside][0] == "schedule" and [e["name"] for e in inside][-1] == "sample"
        # One clock read ends a phase and starts the next: they neither overlap nor leave
        # a gap (up to the rounding of the µs floats of the trace).
        assert all(a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-3) for a, b in itertools.pairwise(inside))

    rec.reset()

    def broken(chunks):  # type: ignore[no-untyped-def]
        raise RuntimeError("forward failed")

    monkeypatch.setattr(engine, "_forward", broken)
    engine.add_request([7, 8, 9], SamplingParams(temperature=0.0, max_tokens=2), lambda out: None)
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    names = [e["name"] for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"]
    assert names == ["schedule", "engine.step"]

    rec.reset()
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True, level="layer"))
    rec._TRACER.skip_cats = frozenset({"engine"})
    assert not rec.records("engine") and rec.records("kda")


@pytest.mark.parametrize("fused", [False, True])
def test_a_mixed_step_records_each_forward_with_its_own_shape(monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    """A step that decodes one request and prefills another: unfused, a ``decode`` and a
    ``prefill`` span, each with its chunks' shape; fused, one ``prefill`` span carrying
    the decode batch; ``engine.step`` has the two together either way."""
    engine = Engine(EngineConfig(preset="tiny", max_running=4, cpu_kernels="torch", dtype="float32",
                                 fuse_prefill_decode=fused))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True, level="step"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request([3] * 5, params, lambda out: None)
    assert engine.step()  # prefills the first request and samples its first token
    rec.reset()
    engine.add_request([4] * 4, params, lambda out: None)
    assert engine.step()  # decodes the first (position 5) and prefills the second
    events = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"]
    by_name = {e["name"]: e["args"] for e in events if "args" in e}
    both = {"batch": 2, "tokens": 5, "context": 6 + 4, "generated": 1}
    if fused:
        assert [e["name"] for e in events] == ["schedule", "prefill", "sample", "engine.step"]
        assert by_name["prefill"] == {"chunks": 1, "decode_batch": 1, "prefill_tokens": 4, **both}
    else:
        assert [e["name"] for e in events] == ["schedule", "decode", "prefill", "sample", "engine.step"]
        assert by_name["decode"] == {"batch": 1, "tokens": 1, "context": 6, "generated": 1}
        assert by_name["prefill"] == {"chunks": 1, "batch": 1, "tokens": 4, "context": 4, "generated": 0}
    assert by_name["sample"] == {"batch": 2} and by_name["engine.step"] == both


@pytest.mark.parametrize(("bounds", "fused", "want"), [
    # (t_step, t_sched, t_decode, t_prefill, t_sample, t_end): each phase starts where the one before ended.
    ((0, 10, 20, -1, 25, 30), 0, [("schedule", 0, 10), ("decode", 10, 20), ("sample", 20, 25), ("engine.step", 0, 30)]),
    ((0, 10, 20, 28, 35, 40), 0, [("schedule", 0, 10), ("decode", 10, 20), ("prefill", 20, 28), ("sample", 28, 35),
                                  ("engine.step", 0, 40)]),
    ((0, 10, -1, 20, 25, 30), 1, [("schedule", 0, 10), ("prefill", 10, 20), ("sample", 20, 25), ("engine.step", 0, 30)]),
    ((0, 10, -1, 20, -1, 21), 0, [("schedule", 0, 10), ("prefill", 10, 20), ("engine.step", 0, 21)]),  # nothing ready
    ((0, 10, -1, -1, -1, 15), 0, [("schedule", 0, 10), ("engine.step", 0, 15)]),  # the forward raised
    ((0, 10, 20, -1, -1, 22), 0, [("schedule", 0, 10), ("decode", 10, 20), ("engine.step", 0, 22)]),  # the next phase raised
    ((0, -1, -1, -1, -1, 5), 0, [("engine.step", 0, 5)]),  # the scheduler raised
])
def test_a_step_record_expands_to_phases_that_start_where_the_last_ended(
        bounds: tuple[int, ...], fused: int, want: list[tuple[str, int, int]]) -> None:
    from refstack.engine import step_trace

    shapes = (step_trace.NO_SHAPE if bounds[1] < 0 else (2, 2, 40, 6)) + ((1, 8, 8, 0) if bounds[3] >= 0 else step_trace.EMPTY_SHAPE)
    events = step_trace.expand((*bounds, fused, 2, *shapes))
    assert [(name, start, end) for name, _, start, end, _ in events] == want
    step_args = events[-1][4]
    assert step_args is None if bounds[1] < 0 else step_args["batch"] == 2 + (1 if bounds[3] >= 0 else 0)
