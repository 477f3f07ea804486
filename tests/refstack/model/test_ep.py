"""The expert-parallel section: same numbers as the plain dispatch/combine, a bounded
modelled wait, the GIL held or released as the knob says, spans on the calling thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import infra_agent.tracing.recorder as rec
from infra_agent.tracing.recorder import Tracer
from refstack.kernels import cpu_kernels, cpu_moe
from refstack.model import HybridConfig, HybridModel, SeqChunk
from refstack.model.moe import EPSettings

NATIVE = pytest.mark.skipif(not cpu_kernels.available(), reason=f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _routing(T: int = 12, D: int = 16, E: int = 8, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return x, ids, w


@NATIVE
@pytest.mark.parametrize("release_gil", [True, False])
def test_ep_dispatch_and_combine_equal_the_moe_kernels(release_gil: bool) -> None:
    x, ids, w = _routing()
    cross = cpu_moe.ep_cross_bytes(ids, 8, 4, 16)
    got = cpu_moe.ep_dispatch(x, ids, w, 8, cross, 1e-3, release_gil=release_gil)
    want = cpu_moe.moe_dispatch(x, ids, w, 8)
    for a, b in zip(got, want):
        assert a == b if isinstance(a, list) else torch.equal(a, b)
    out = torch.randn(ids.numel(), 16)
    y = cpu_moe.ep_combine(out, got[2], w, cross, 1e-3, release_gil=release_gil)
    assert torch.equal(y, cpu_moe.moe_combine(out, got[2], w))


@NATIVE
def test_cross_bytes_counts_copies_leaving_their_home_rank() -> None:
    # 4 tokens, 2 ranks of 2 experts: tokens 0-1 live on rank 0, tokens 2-3 on rank 1.
    ids = torch.tensor([[0, 2], [1, 3], [0, 1], [2, 3]])
    # crossing copies: (0,2), (1,3), (2,0), (2,1) -> 4 rows of 8 floats
    assert cpu_moe.ep_cross_bytes(ids, 4, 2, 8) == 4 * 8 * 4
    assert cpu_moe.ep_cross_bytes(ids, 4, 1, 8) == 0


@NATIVE
def test_wait_is_proportional_and_bounded() -> None:
    t = time.perf_counter()
    spun = cpu_moe.ep_wait(20_000_000, 1.0)  # 20 MB at 1 GB/s (1 ns a byte): 20 ms
    assert 20e6 <= spun and time.perf_counter() - t >= 0.02
    assert cpu_moe.ep_wait(10**12, 1.0) < 60e6  # capped at 50 ms
    assert cpu_moe.ep_wait(10**6, 0.0) == 0


@NATIVE
@pytest.mark.parametrize("release_gil", [True, False])
def test_the_gil_is_held_only_when_asked(release_gil: bool) -> None:
    """A Python thread stamps the clock in a loop while the main thread spins 40 ms in
    the native section; stamps inside the spin mean the section let it run."""
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())
            for _ in range(200):
                pass

    t = threading.Thread(target=stamp, daemon=True)
    t.start()
    time.sleep(0.02)
    try:
        inside = []
        for _ in range(3):  # best of three: a busy machine may deschedule the stamping thread
            t0 = time.perf_counter()
            cpu_moe.ep_wait(40_000_000, 1.0, release_gil=release_gil)  # 40 ms
            inside.append(sum(t0 + 0.002 < x < t0 + 0.038 for x in list(stamps)))
    finally:
        stop.set()
        t.join()
    if release_gil:
        assert max(inside) > 20, inside
    else:
        assert inside == [0, 0, 0], inside


@pytest.mark.parametrize("native", [pytest.param(True, marks=NATIVE), False])
def test_model_spans_and_logits_with_the_gil_held(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(native)
    chunks = [SeqChunk(0, list(range(1, 20)), 0), SeqChunk(1, [7], 0)]
    want = model.forward_chunks(chunks, model.new_cache(num_slots=2))
    model.configure_ep(EPSettings(release_gil=False, link_gbps=1.0))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    got = model.forward_chunks(chunks, model.new_cache(num_slots=2))
    assert torch.equal(got, want)  # the section changes where the GIL is, never a number
    snap = rec.snapshot()
    spans = [e for e in snap["traceEvents"] if e["ph"] == "X"]
    names = {e["name"]: e for e in spans}
    for name in ("ep.dispatch", "ep.combine"):
        ev = names[name]
        assert ev["cat"] == "ep" and ev["args"]["gil"] == "held"
        assert ev["tid"] == threading.get_native_id()
        if cpu_kernels.available():
            assert ev["args"]["bytes"] > 0
    assert sum(e["name"] == "ep.dispatch" for e in spans) == model.config.num_layers
    # Each ep section sits inside its moe phase.
    for ep_name, moe_name in (("ep.dispatch", "moe.dispatch"), ("ep.combine", "moe.combine")):
        for ep in (e for e in spans if e["name"] == ep_name):
            assert any(m["ts"] <= ep["ts"] + 1e-3 and ep["ts"] + ep["dur"] <= m["ts"] + m["dur"] + 1e-3
                       for m in spans if m["name"] == moe_name)


@NATIVE
def test_native_decode_path_runs_the_ep_section(monkeypatch: pytest.MonkeyPatch) -> None:
    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(True)
    cache = model.new_cache(num_slots=2)
    model.forward_chunks([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4, 5], 0)], cache)
    decode = [SeqChunk(0, [9], 3), SeqChunk(1, [8], 2)]
    before = [t.clone() for t in cache.states.values()]
    want = model.forward_chunks(decode, cache)
    for t, b in zip(cache.states.values(), before):
        t.copy_(b)
    model.configure_ep(EPSettings(release_gil=False, link_gbps=0.5))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    got = model.forward_chunks(decode, cache)
    assert torch.equal(got, want)
    spans = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X" and e["cat"] == "ep"]
    assert {e["name"] for e in spans} == {"ep.dispatch", "ep.combine"}
    assert all(e["args"]["gil"] == "held" and e["args"]["tokens"] == 2 for e in spans)


@NATIVE
def test_native_decode_records_only_the_categories_the_tracer_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native step's per-layer records carry which categories were recorded: a
    tracer that keeps only "ep" gets the exchange spans and no mixer or moe ones, and the
    layer level gets every layer's six, each ep span inside its moe phase."""
    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(True)
    cache = model.new_cache(num_slots=2)
    model.forward_chunks([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4, 5], 0)], cache)
    tracer = Tracer(enabled=True)
    tracer.skip_cats = frozenset({"kda", "attn", "moe", "model", "lm_head"})
    monkeypatch.setattr(rec, "_TRACER", tracer)
    model.forward_chunks([SeqChunk(0, [9], 3), SeqChunk(1, [8], 2)], cache)
    names = [e["name"] for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"]
    assert names == ["ep.dispatch", "ep.combine"] * model.config.num_layers

    rec.reset()
    tracer.skip_cats = frozenset()
    model.forward_chunks([SeqChunk(0, [7], 4), SeqChunk(1, [6], 3)], cache)
    spans = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"]
    layers = model.config.num_layers
    mixers = [e for e in spans if e["name"] in ("kda", "attention")]
    assert [e["args"]["layer"] for e in mixers] == list(range(layers))
    assert all(e["args"]["tokens"] == 2 for e in mixers)
    for inner, outer in (("ep.dispatch", "moe.dispatch"), ("ep.combine", "moe.combine")):
        pairs = list(zip((e for e in spans if e["name"] == inner), (e for e in spans if e["name"] == outer), strict=True))
        assert len(pairs) == layers
        assert all(o["ts"] <= i["ts"] and i["ts"] + i["dur"] <= o["ts"] + o["dur"] for i, o in pairs)
    experts = [e for e in spans if e["name"] == "moe.experts"]
    assert [e["args"]["layer"] for e in experts] == list(range(layers))
    # The step's own record: model.forward around every layer and the LM head, with the
    # module path's args.
    (forward,) = (e for e in spans if e["name"] == "model.forward")
    (head,) = (e for e in spans if e["name"] == "lm_head")
    assert forward["cat"] == "model" and forward["args"] == {"num_chunks": 2, "tokens": 2}
    assert head["cat"] == "lm_head" and head["args"] == {"tokens": 2, "precision": model.config.lm_head_precision}
    end = forward["ts"] + forward["dur"]
    assert all(forward["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end for e in spans if e is not forward)
    assert max(e["ts"] + e["dur"] for e in spans if e["name"] == "moe.combine") <= head["ts"]


@NATIVE
def test_native_decode_keeps_its_step_spans_when_the_lm_head_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing LM head still leaves ``model.forward`` and ``lm_head`` in the trace (the
    module path's span objects would record them on the way out), each ending with the step."""
    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(True)
    cache = model.new_cache(num_slots=2)
    model.forward_chunks([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4, 5], 0)], cache)
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))

    def broken(h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("lm head failed")

    monkeypatch.setattr(model.lm_head, "logits", broken)
    with pytest.raises(RuntimeError, match="lm head failed"):
        model.forward_chunks([SeqChunk(0, [9], 3), SeqChunk(1, [8], 2)], cache)
    spans = {e["name"]: e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"}
    forward, head = spans["model.forward"], spans["lm_head"]
    assert head["ts"] + head["dur"] == pytest.approx(forward["ts"] + forward["dur"], abs=1e-3)
    assert sum(1 for name in spans if name in ("kda", "attention")) >= 1


class _FailingLib:
    """The native library, but ``fail`` returns an error on its ``on``-th call (1-based)."""

    def __init__(self, lib: object, fail: str, on: int) -> None:
        self._lib, self._fail, self._on, self.calls = lib, fail, on, 0

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._lib, name)
        if name != self._fail:
            return fn

        def call(*args: object) -> int:
            self.calls += 1
            return 1 if self.calls == self._on else fn(*args)

        return call


@NATIVE
def test_native_decode_keeps_only_the_layers_before_a_failing_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels mark a failing call too (the span closes on every return); the step's
    record keeps the layers before the one that failed and none after it."""
    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(True)
    cache = model.new_cache(num_slots=2)
    model.forward_chunks([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4, 5], 0)], cache)
    decoder = model.native_decoder
    assert decoder is not None
    layer = decoder.layers[1]
    experts = "refstack_moe_experts_w8a8" if layer.experts_w8a8 else \
        "refstack_moe_experts_bf16" if layer.experts_bf16 else "refstack_moe_experts"
    monkeypatch.setattr(decoder, "lib", _FailingLib(decoder.lib, experts, on=2))
    monkeypatch.setattr(rec, "_TRACER", Tracer(enabled=True))
    with pytest.raises(RuntimeError, match="moe_experts returned 1"):
        model.forward_chunks([SeqChunk(0, [9], 3), SeqChunk(1, [8], 2)], cache)
    spans = [e for e in rec.snapshot()["traceEvents"] if e["ph"] == "X"]
    per_layer = [e for e in spans if e["cat"] in ("kda", "attn", "moe", "ep")]
    # Layer 0 whole (its six spans); layer 1's experts failed: nothing of it or after it.
    assert [e["name"] for e in per_layer] == ["kda" if decoder.kinds[0] else "attention", "ep.dispatch", "moe.dispatch",
                                              "moe.experts", "ep.combine", "moe.combine"]
    assert {e["name"] for e in spans} >= {"model.forward"}


@NATIVE
def test_an_untraced_native_step_stops_the_kernels_marking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels write marks into a traced step's record; once a step runs untraced they
    stop, so tracing off costs the kernels nothing and leaves the record alone."""
    from refstack.model import decode_trace

    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(True)
    cache = model.new_cache(num_slots=2)
    model.forward_chunks([SeqChunk(0, [1, 2, 3], 0), SeqChunk(1, [4, 5], 0)], cache)
    tracer = Tracer(enabled=True)
    monkeypatch.setattr(rec, "_TRACER", tracer)
    model.forward_chunks([SeqChunk(0, [9], 3), SeqChunk(1, [8], 2)], cache)
    decoder = model.native_decoder
    assert decoder is not None
    record = decode_trace._local.records[decoder.kinds]
    layers = model.config.num_layers
    assert record.values[record.log_at] == decode_trace.MARKS_PER_LAYER * layers
    record.values[record.log_at] = 0
    tracer.enabled = False
    model.forward_chunks([SeqChunk(0, [7], 4), SeqChunk(1, [6], 3)], cache)
    assert record.values[record.log_at] == 0
    tracer.enabled = True
    model.forward_chunks([SeqChunk(0, [5], 5), SeqChunk(1, [4], 4)], cache)
    assert record.values[record.log_at] == decode_trace.MARKS_PER_LAYER * layers
