"""The engine on the real tiny model, driven in-process (no thread, no server)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from refstack.engine import Engine, EngineConfig, QueueFullError, SamplingParams
from refstack.model import ByteTokenizer, HybridConfig, HybridModel

TOK = ByteTokenizer()
PROMPTS = [
    "The quick brown fox",
    "Hi",
    "Continuous batching keeps every slot of the cache busy while requests come and go.",
    "KDA linear attention carries a recurrent state; GQA keeps a KV cache.",
    "x" * 40,
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(HybridConfig.preset("tiny"))


def make_engine(model: HybridModel, **knobs: object) -> Engine:
    return Engine(EngineConfig(preset="tiny", **knobs), model=model, tokenizer=TOK)  # type: ignore[arg-type]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=True)


def test_greedy_output_is_the_same_alone_and_in_a_batch(model: HybridModel) -> None:
    alone = [make_engine(model).generate([ids(p)], GREEDY)[0] for p in PROMPTS]
    # Small budgets force chunked prefill, and prefill chunks sharing steps with decodes.
    batched = make_engine(model, max_batch_tokens=24, prefill_chunk=7).generate([ids(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [o.text for o in batched] == [o.text for o in alone]
    assert all(len(o.token_ids) == GREEDY.max_tokens and o.finish_reason == "length" for o in batched)
    fused = make_engine(model, max_batch_tokens=24, prefill_chunk=7, fuse_prefill_decode=True).generate(
        [ids(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in fused] == [o.token_ids for o in alone]


def test_greedy_output_does_not_depend_on_which_slot_or_neighbours(model: HybridModel) -> None:
    engine = make_engine(model, max_running=3)
    first = engine.generate([ids(PROMPTS[2])], GREEDY)[0]
    # Same prompt again, now behind two others so it lands in slot 2 with a reused state.
    again = engine.generate([ids(PROMPTS[0]), ids(PROMPTS[1]), ids(PROMPTS[2])], GREEDY)[2]
    assert again.token_ids == first.token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(model: HybridModel) -> None:
    def run(seed: int, batch: bool) -> tuple[int, ...]:
        p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)
        other = SamplingParams(max_tokens=6, temperature=0.7, seed=seed + 99, ignore_eos=True)
        prompts = [ids(PROMPTS[1])] + ([ids(PROMPTS[0])] if batch else [])
        params = [p] + ([other] if batch else [])
        return make_engine(model).generate(prompts, params)[0].token_ids

    assert run(7, batch=False) == run(7, batch=False)
    assert run(7, batch=True) == run(7, batch=False)
    assert run(7, batch=False) != run(8, batch=False)


def test_tiny_top_p_is_greedy(model: HybridModel) -> None:
    greedy = make_engine(model).generate([ids(PROMPTS[0])], GREEDY)[0]
    nucleus = make_engine(model).generate(
        [ids(PROMPTS[0])], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert nucleus.token_ids == greedy.token_ids


def test_stop_string_cuts_the_text_and_ends_the_request(model: HybridModel) -> None:
    long = make_engine(model).generate([ids(PROMPTS[1])], SamplingParams(max_tokens=30, temperature=0.0,
                                                                           ignore_eos=True))[0]
    # A stop string taken from inside the greedy text, preferring two characters, and
    # skipping U+FFFD (it stands for bytes that are not valid UTF-8 on their own).
    text = long.text
    candidates = [text[i : i + k] for k in (2, 1) for i in range(1, len(text) - k) if "\ufffd" not in text[i : i + k]]
    assert candidates, f"greedy text {text!r} holds no usable stop string"
    stop = candidates[0]
    out = make_engine(model).generate([ids(PROMPTS[1])], SamplingParams(max_tokens=30, temperature=0.0,
                                                                          ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == long.text[: long.text.index(stop)]
    assert len(out.token_ids) < len(long.token_ids)


def test_max_tokens_and_context_end_give_length(model: HybridModel) -> None:
    out = make_engine(model).generate([ids("abc")], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert (out.finish_reason, out.completion_tokens, len(out.token_ids)) == ("length", 5, 5)
    # The engine itself stops at the end of the context even if max_tokens allows more.
    short = make_engine(model, max_seq_len=32).generate(
        [ids("a" * 20)], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert short.finish_reason == "length"
    assert short.prompt_tokens + short.completion_tokens == 32


def test_abort_frees_the_slot_and_a_full_queue_refuses(model: HybridModel) -> None:
    engine = make_engine(model, max_running=1, max_waiting=1)
    seen = []
    rid = engine.add_request(ids(PROMPTS[0]), SamplingParams(max_tokens=50, ignore_eos=True), seen.append)
    engine.step()
    engine.step()
    assert engine.num_slots_used == 1 and engine.num_running == 1
    engine.add_request(ids(PROMPTS[1]), GREEDY, seen.append)  # waits: max_running is 1
    with pytest.raises(QueueFullError):
        engine.add_request(ids(PROMPTS[1]), GREEDY, seen.append)
    engine.abort(rid)
    engine.step()  # processes the abort, then admits the waiting request into the freed slot
    aborted = [o for o in seen if o.request_id == rid and o.finished]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert engine.num_running == 1 and engine.num_waiting == 0
    while engine.step():
        pass
    assert engine.num_slots_used == 0 and engine.num_running == 0


def test_loop_thread_streams_to_asyncio_and_early_exit_aborts(model: HybridModel) -> None:
    engine = make_engine(model)
    engine.start()
    try:
        assert [t for t in threading.enumerate() if t.name == "engine-loop"]

        async def consume() -> tuple[list[int], list[int]]:
            full = engine.submit(ids(PROMPTS[0]), GREEDY)
            got = [t for out in [o async for o in full] for t in out.token_ids]
            partial: list[int] = []
            async for out in engine.submit(ids(PROMPTS[0]), SamplingParams(max_tokens=400, ignore_eos=True)):
                partial += out.token_ids
                if len(partial) >= 2:
                    break  # leaving the loop aborts the request
            return got, partial

        got, partial = asyncio.run(consume())
        assert tuple(got) == make_engine(model).generate([ids(PROMPTS[0])], GREEDY)[0].token_ids
        deadline = time.monotonic() + 10
        while engine.num_slots_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_slots_used == 0 and engine.num_running == 0
    finally:
        engine.stop()
    assert not engine.is_running


def test_only_printable_ids_are_generated(model: HybridModel) -> None:
    # Random weights favour the unused padding ids above the tokenizer's range; the
    # engine must never emit them (nor bos/pad/im_start), or clients get empty tokens.
    params = SamplingParams(max_tokens=24, temperature=1.5, seed=3, ignore_eos=True)
    outs = make_engine(model).generate([ids(p) for p in PROMPTS], params)
    emitted = [t for o in outs for t in o.token_ids]
    assert len(emitted) == 24 * len(PROMPTS)
    assert max(emitted) < TOK.vocab_size
    assert not set(emitted) & set(TOK.prompt_only_ids)


def test_step_slowdown_stretches_the_step_period_in_proportion(model: HybridModel) -> None:
    # The calibration knob spins for s x the previous step-to-step period, so steps per
    # second fall by s; a trace shows each spin as its own span.
    import infra_agent.tracing.recorder as rec
    from infra_agent.tracing.recorder import Tracer

    tracer = Tracer(enabled=True)
    old, rec._TRACER = rec._TRACER, tracer
    try:
        make_engine(model, step_slowdown=0.5).generate([ids(PROMPTS[0])], GREEDY)
    finally:
        rec._TRACER = old
    events = [e for e in tracer.snapshot()["traceEvents"] if e.get("ph") == "X"]
    starts = [e["ts"] for e in events if e["name"] == "engine.step"]
    spins = [e for e in events if e["name"] == "step_slowdown"]
    assert len(starts) == len(spins) >= GREEDY.max_tokens
    # Exact on the engine's own clock: each spin lasts at least 0.5 x the period it read
    # (it can last longer when the OS preempts the spinning thread).
    assert all(e["dur"] >= 0.5 * e["args"]["base_us"] * 0.999 for e in spins), spins
    # And the period it read is the step-to-step period a trace shows: the median over
    # the run, since one preemption between two clock reads can shift a single step.
    periods = [b - a for a, b in zip(starts, starts[1:])]
    bases = [e["args"]["base_us"] for e in spins[1:]]
    ratios = sorted(base / period for base, period in zip(bases, periods))
    assert 0.9 <= ratios[len(ratios) // 2] <= 1.1, ratios


def test_native_and_torch_kernels_generate_the_same_greedy_text(model: HybridModel) -> None:
    from refstack.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")
    prompts = [ids(p) for p in PROMPTS]
    native = make_engine(model, cpu_kernels="native")
    assert native.native_kernels and model.native_kernels
    out_native = native.generate(prompts, GREEDY)
    plain = make_engine(model, cpu_kernels="torch")
    assert not plain.native_kernels and not model.native_kernels
    out_torch = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in out_native] == [o.token_ids for o in out_torch]
    make_engine(model)  # "auto": back to native for the module's other tests
    assert model.native_kernels


def test_bf16_engine_output_is_the_same_alone_and_in_a_batch() -> None:
    engine = Engine(EngineConfig(preset="tiny", dtype="bfloat16"))
    assert engine.model.config.dtype == "bfloat16"
    model = engine.model
    alone = [make_engine(model).generate([ids(p)], GREEDY)[0] for p in PROMPTS]
    batched = make_engine(model, max_batch_tokens=24, prefill_chunk=7).generate([ids(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    fused = make_engine(model, max_batch_tokens=24, prefill_chunk=7, fuse_prefill_decode=True).generate(
        [ids(p) for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in fused] == [o.token_ids for o in alone]


def test_dtype_auto_is_bf16_only_on_the_native_kernels_with_a_bf16_dot_product() -> None:
    from refstack.engine.config import resolve_dtype
    from refstack.kernels import cpu_kernels

    fast_bf16 = cpu_kernels.available() and cpu_kernels.bf16_dot_native()
    assert resolve_dtype("auto", "auto") == ("bfloat16" if fast_bf16 else "float32")
    assert resolve_dtype("auto", "torch") == "float32"
    for explicit in ("float32", "bfloat16"):
        assert resolve_dtype(explicit, "torch") == explicit
    engine = Engine(EngineConfig(preset="tiny"))  # the launch default
    assert engine.dtype == engine.model.config.dtype == resolve_dtype("auto", "auto")
    assert Engine(EngineConfig(preset="tiny", cpu_kernels="torch")).dtype == "float32"


def test_dtype_auto_follows_the_probe_and_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from refstack.engine.config import DTYPES, resolve_dtype
    from refstack.kernels import cpu_kernels
    from refstack.model.config import DTYPES as MODEL_DTYPES

    assert DTYPES == ("auto", *MODEL_DTYPES)
    for native_bf16, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(cpu_kernels, "bf16_dot_native", lambda v=native_bf16: v)
        assert resolve_dtype("auto", "auto") == resolve_dtype("auto", "native") == expected
        assert resolve_dtype("auto", "torch") == "float32"


def test_an_explicit_dtype_that_contradicts_the_given_model_is_refused() -> None:
    model = HybridModel(HybridConfig.preset("tiny"))  # float32
    with pytest.raises(ValueError, match="dtype='bfloat16' but the model given was built with dtype='float32'"):
        Engine(EngineConfig(preset="tiny", dtype="bfloat16"), model=model, tokenizer=TOK)
    assert Engine(EngineConfig(preset="tiny", dtype="float32"), model=model, tokenizer=TOK).dtype == "float32"


def test_gc_freeze_moves_the_built_engine_out_of_the_collectors_reach(model: HybridModel) -> None:
    import gc

    gc.unfreeze()
    try:
        make_engine(model, gc_freeze=False)
        assert gc.get_freeze_count() == 0
        make_engine(model, gc_freeze=True)
        # The model's modules and tensors are frozen: a full collection no longer walks them.
        frozen = gc.get_freeze_count()
        assert frozen > 1000
    finally:
        gc.unfreeze()


def test_call_on_loop_runs_on_the_engine_thread_and_hands_back_errors(model: HybridModel) -> None:
    engine = make_engine(model)
    assert engine.call_on_loop(lambda: threading.current_thread().name) == threading.current_thread().name  # inline
    engine.start()
    try:
        assert engine.call_on_loop(lambda: threading.current_thread().name) == "engine-loop"
        with pytest.raises(ZeroDivisionError):
            engine.call_on_loop(lambda: 1 // 0)
        # The loop goes on serving after a failed call.
        assert engine.generate([ids(PROMPTS[1])], GREEDY)[0].token_ids
    finally:
        engine.stop()
