from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

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
