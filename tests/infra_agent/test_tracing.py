from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from infra_agent.tracing import int_records
from infra_agent.tracing.recorder import Tracer, span


def test_disabled_tracer_records_nothing(monkeypatch):
    import infra_agent.tracing.recorder as rec

    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=False))
    with span("x", cat="t"):
        pass

    @span("decorated")
    def f(a):
        return a + 1

    assert f(1) == 2
    assert [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"] == []


def test_spans_land_on_their_threads_with_names(monkeypatch):
    import infra_agent.tracing.recorder as rec

    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))

    @span("work", cat="worker", k=3)
    def work():
        with span("inner", cat="worker"):
            pass

    t = threading.Thread(target=work, name="transfer-thread")
    t.start()
    t.join()
    with span("main-span", cat="main"):
        pass
    trace = rec.snapshot()
    names = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "transfer-thread" in names
    by_name = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert by_name["work"]["tid"] == names["transfer-thread"]
    assert by_name["inner"]["tid"] == names["transfer-thread"]
    assert by_name["main-span"]["tid"] != names["transfer-thread"]
    assert by_name["work"]["args"] == {"k": 3}
    # Nesting: the inner span lies within the outer one.
    outer, inner = by_name["work"], by_name["inner"]
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_env_var_writes_chrome_trace_at_exit(tmp_path: Path):
    out = tmp_path / "t.json"
    code = textwrap.dedent(
        """
        from infra_agent import tracing
        with tracing.span("hello", cat="demo"):
            pass
        """
    )
    env = dict(os.environ, INFRA_AGENT_TRACE=str(out))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    trace = json.loads(out.read_text())
    assert any(e["name"] == "hello" and e["ph"] == "X" and e["cat"] == "demo" for e in trace["traceEvents"])


def test_step_level_leaves_out_per_layer_spans_and_is_named_in_the_trace() -> None:
    import pytest

    from infra_agent import tracing
    from infra_agent.tracing.recorder import level_skips

    tracing.enable(level="step")
    try:
        tracing.reset()
        with tracing.span("engine.step", cat="engine"):
            with tracing.span("kda", cat="kda", layer=0):
                pass
            with tracing.span("ep.dispatch", cat="ep"):
                pass
            with tracing.span("decode", cat="engine"), tracing.span("model.forward", cat="model"):
                with tracing.span("lm_head", cat="lm_head"):
                    pass
        tracing.instant("moe.note", cat="moe")
        trace = tracing.snapshot()
        names = [e["name"] for e in trace["traceEvents"] if e["ph"] != "M"]
        # decode ends before engine.step; the forward and the LM head inside it are left out.
        assert names == ["decode", "engine.step"] and trace["otherData"]["level"] == "step"
    finally:
        tracing.enable(level="layer")
        tracing.disable()
        tracing.reset()
    assert Tracer(level="layer").skip_cats == frozenset()
    with pytest.raises(ValueError, match="trace level 'fine'"):
        level_skips("fine")


def test_records_of_a_layout_expand_on_their_thread_when_read_and_a_full_buffer_counts_drops(monkeypatch):
    """``int_sink`` records are integers until the trace is read; then the layout's
    expander turns each into its events, on the thread that recorded it."""
    import infra_agent.tracing.recorder as rec

    def expand(v):
        start, mid, end, n = v
        return [("a", "hot", start, mid, {"n": n}), ("b", "hot", mid, end, None), ("mark", "hot", end, -1, None)]

    layout = rec.register_layout(4, expand)
    with pytest.raises(ValueError, match="at least one integer"):
        rec.register_layout(0, expand)
    tracer = Tracer(enabled=True, level="step")
    monkeypatch.setattr(rec, "_TRACER", tracer)
    assert rec.int_sink("kda") is None  # the step level leaves "kda" out
    t0 = tracer.origin_perf_ns
    rec.int_sink("hot")(layout.pack(layout.id, t0 + 1000, t0 + 3000, t0 + 6000, 7))

    def other_thread() -> None:
        sink = rec.int_sink("hot")
        assert sink is not None
        sink(layout.pack(layout.id, t0 + 10_000, t0 + 11_000, t0 + 12_000, 8))

    worker = threading.Thread(target=other_thread, name="recorder-2")
    worker.start()
    worker.join()
    events = [e for e in rec.snapshot()["traceEvents"] if e["ph"] != "M"]
    assert [(e["name"], e["ph"], e["ts"], e.get("dur"), e.get("args")) for e in events] == [
        ("a", "X", 1.0, 2.0, {"n": 7}), ("b", "X", 3.0, 3.0, None), ("mark", "i", 6.0, None, None),
        ("a", "X", 10.0, 1.0, {"n": 8}), ("b", "X", 11.0, 1.0, None), ("mark", "i", 12.0, None, None)]
    assert events[0]["tid"] == threading.get_native_id() and events[3]["tid"] == worker.native_id

    rec.reset()
    assert [e for e in rec.snapshot()["traceEvents"] if e["ph"] != "M"] == []
    monkeypatch.setattr(rec, "MAX_INT_BYTES", 5 * 8)  # room for one record
    rec.int_sink("hot")(layout.pack(layout.id, t0, t0, t0, 1))
    rec.int_sink("hot")(layout.pack(layout.id, t0, t0, t0, 2))  # the buffer is full: counted, not kept
    trace = rec.snapshot()
    assert [e["args"]["n"] for e in trace["traceEvents"] if e["name"] == "a"] == [1]
    assert trace["otherData"]["dropped_events"] == 1


def test_a_bad_integer_record_keeps_the_records_before_it_and_the_trace_readable(monkeypatch, caplog):
    """A record is packed whole or not at all; bytes a writer hands its sink that no
    layout can read (an unknown id, another width, an expander that raises) keep what came
    before them, count the rest as dropped, and a warning says where: the trace stays
    readable."""
    import infra_agent.tracing.recorder as rec

    layout = rec.register_layout(2, lambda v: [("ok", "hot", v[0], v[1], None)])
    broken = rec.register_layout(1, lambda v: [][v[0]])  # an expander with a bug
    tracer = Tracer(enabled=True)
    monkeypatch.setattr(rec, "_TRACER", tracer)
    t0 = tracer.origin_perf_ns
    sink = rec.int_sink("hot")
    sink(layout.pack(layout.id, t0, t0 + 1000))
    with pytest.raises(struct.error):
        sink(layout.pack(layout.id, t0, None))  # nothing of it is kept
    with pytest.raises(struct.error):
        sink(layout.pack(layout.id, t0))  # nor of a record one value short
    sink(layout.pack(layout.id, t0 + 2000, t0 + 3000))
    assert [e["ts"] for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"] == [0.0, 2.0]

    for bad in (struct.pack("=3q", len(int_records._LAYOUTS) + 5, 1, 2),  # no such layout
                broken.pack(broken.id, 0),  # its expander raises
                layout.pack(layout.id, t0 + 5000, t0 + 4000)):  # ends before it starts: read out of step
        rec.reset()
        sink(layout.pack(layout.id, t0, t0 + 1000))
        sink(bad)
        sink(layout.pack(layout.id, t0 + 2000, t0 + 3000))
        with caplog.at_level("WARNING", logger="infra_agent.tracing.recorder"):
            trace = rec.snapshot()
        assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["ok"]
        assert trace["otherData"]["dropped_events"] == 1
        assert "could not be read as records" in caplog.text and "from offset 3" in caplog.text
