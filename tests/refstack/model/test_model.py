"""The model gives the same next-token logits however a sequence is split into steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from refstack.kernels import cpu_kernels
from refstack.model import ByteTokenizer, HybridConfig, HybridModel, SeqChunk

ATOL, RTOL = 2e-5, 1e-5


@pytest.fixture(scope="module", params=["torch", "native", "torch-bf16", "native-bf16"])
def model(request: pytest.FixtureRequest) -> HybridModel:
    """Every property below holds on torch's matmuls and on the native CPU kernels, with
    fp32 and with bf16 GEMM operands."""
    m = HybridModel(HybridConfig.preset("tiny", dtype="bfloat16" if request.param.endswith("bf16") else "float32"))
    if request.param.startswith("native"):
        if not cpu_kernels.available():
            pytest.skip(f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")
        m.use_native_kernels(True)
    return m


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(model: HybridModel, cache, slot: int, ids: list[int], splits: list[int]) -> torch.Tensor:
    """Feed ``ids`` in pieces ending at each split point; the last piece's logits."""
    start = 0
    logits = None
    for end in [*splits, len(ids)]:
        logits = model.forward_chunks([SeqChunk(slot, ids[start:end], start)], cache)
        start = end
    assert logits is not None
    return logits[0]


def test_prefill_whole_equals_chunks_equals_token_by_token(model: HybridModel) -> None:
    ids = _prompt(45, seed=0)  # crosses KDA chunks (16) and is not a multiple of them
    cache = model.new_cache(num_slots=3)
    whole = _prefill(model, cache, 0, ids, [])
    chunked = _prefill(model, cache, 1, ids, [7, 20, 33])
    stepped = _prefill(model, cache, 2, ids, list(range(1, len(ids))))
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(stepped, whole, atol=ATOL, rtol=RTOL)
    assert whole.shape == (model.config.vocab_size,)


@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [5, 1, 6, 3]])  # consecutive (sliced) and scattered (gathered)
def test_batched_decode_equals_each_alone(model: HybridModel, slots: list[int]) -> None:
    lengths = [3, 17, 30, 9]
    prompts = [_prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    batched = model.new_cache(num_slots=8)
    alone = model.new_cache(num_slots=8)
    for slot, p in zip(slots, prompts):
        model.forward_chunks([SeqChunk(slot, p, 0)], batched)
        model.forward_chunks([SeqChunk(slot, p, 0)], alone)
    next_tokens = [7, 300, 65, 128]
    for step in range(3):
        chunks = [SeqChunk(s, [t], n + step) for s, t, n in zip(slots, next_tokens, lengths)]
        out = model.forward_chunks(chunks, batched)
        assert out.shape == (len(chunks), model.config.vocab_size)
        for i, c in enumerate(chunks):
            ref = model.forward_chunks([c], alone)[0]
            torch.testing.assert_close(out[i], ref, atol=ATOL, rtol=RTOL)
        next_tokens = out.argmax(-1).tolist()


def test_mixed_prefill_and_decode_batch(model: HybridModel) -> None:
    a, b, c = _prompt(12, seed=20), _prompt(25, seed=21), _prompt(6, seed=22)
    mixed = model.new_cache(num_slots=4)
    alone = model.new_cache(num_slots=4)
    for cache in (mixed, alone):
        model.forward_chunks([SeqChunk(0, a, 0)], cache)
        model.forward_chunks([SeqChunk(1, b[:10], 0)], cache)
        model.forward_chunks([SeqChunk(2, c, 0)], cache)  # slot 2 is used, then gets a one-token prompt
    # Order in the call is kept in the output: prefill, decode, new prefill, a fresh one-token prompt.
    chunks = [SeqChunk(1, b[10:], 10), SeqChunk(0, [42], 12), SeqChunk(3, c, 0), SeqChunk(2, [7], 0)]
    out = model.forward_chunks(chunks, mixed)
    for i, ch in enumerate(chunks):
        torch.testing.assert_close(out[i], model.forward_chunks([ch], alone)[0], atol=ATOL, rtol=RTOL)


def test_start_pos_zero_ignores_a_stale_slot(model: HybridModel) -> None:
    cache = model.new_cache(num_slots=2)
    ids = _prompt(20, seed=30)
    fresh = model.forward_chunks([SeqChunk(0, ids, 0)], cache)
    model.forward_chunks([SeqChunk(1, _prompt(33, seed=31), 0)], cache)  # slot 1 now holds another sequence
    reused = model.forward_chunks([SeqChunk(1, ids, 0)], cache)  # no reset_slot on purpose
    torch.testing.assert_close(reused, fresh, atol=ATOL, rtol=RTOL)
    one = model.forward_chunks([SeqChunk(0, [5], 0)], cache)  # one-token prompt on a used slot
    cache.reset_slot(1)
    torch.testing.assert_close(model.forward_chunks([SeqChunk(1, [5], 0)], cache), one, atol=ATOL, rtol=RTOL)


def test_weights_are_deterministic_per_seed() -> None:
    cfg = HybridConfig.preset("tiny")
    a, b, c = HybridModel(cfg), HybridModel(cfg), HybridModel(cfg.with_overrides(seed=1))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["embed.weight"], sc["embed.weight"])


def test_greedy_decoding_is_not_degenerate(model: HybridModel) -> None:
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    cache = model.new_cache(num_slots=1)
    logits = model.forward_chunks([SeqChunk(0, ids, 0)], cache)[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    out = []
    for pos in range(len(ids), len(ids) + 24):
        out.append(int(logits.argmax()))
        logits = model.forward_chunks([SeqChunk(0, [out[-1]], pos)], cache)[0]
    assert len(set(out)) > 4, out


def test_lm_head_precision_modes_stay_close_to_fp32(model: HybridModel) -> None:
    ids = _prompt(10, seed=40)
    ref = model.forward_chunks([SeqChunk(0, ids, 0)], model.new_cache(1))
    for precision, tol in (("3xtf32", 1e-5), ("tf32", 2e-2), ("bf16", 5e-2)):
        other = HybridModel(model.config.with_overrides(lm_head_precision=precision))
        got = other.forward_chunks([SeqChunk(0, ids, 0)], other.new_cache(1))
        torch.testing.assert_close(got, ref, atol=tol, rtol=0)


def test_bad_chunks_are_rejected(model: HybridModel) -> None:
    cache = model.new_cache(num_slots=2, max_seq_len=16)
    with pytest.raises(ValueError, match="twice"):
        model.forward_chunks([SeqChunk(0, [1], 3), SeqChunk(0, [2], 4)], cache)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.forward_chunks([SeqChunk(0, list(range(10)), 10)], cache)
    with pytest.raises(ValueError, match="outside"):
        model.forward_chunks([SeqChunk(2, [1], 0)], cache)
    with pytest.raises(ValueError, match="no tokens"):
        model.forward_chunks([SeqChunk(0, [], 0)], cache)


@pytest.mark.parametrize(
    ("lengths", "padded"),
    [([20, 17, 23, 20], True), ([40, 3, 2], False)],  # one padded batch / per-sequence fallback
)
def test_many_prefills_in_one_call_equal_each_alone(model: HybridModel, lengths: list[int], padded: bool) -> None:
    from refstack.model.batch import ForwardBatch

    prompts = [_prompt(10 + n, seed=50 + i) for i, n in enumerate(lengths)]
    together = model.new_cache(num_slots=len(lengths))
    alone = model.new_cache(num_slots=len(lengths))
    # Slot 0 continues a sequence (start_pos 10); the others start fresh.
    for cache in (together, alone):
        model.forward_chunks([SeqChunk(0, prompts[0][:10], 0)], cache)
    chunks = [SeqChunk(0, prompts[0][10:], 10)] + [
        SeqChunk(i, p[: lengths[i]], 0) for i, p in enumerate(prompts) if i > 0
    ]
    batch = ForwardBatch.from_chunks(chunks, together.num_slots, together.max_seq_len)
    assert (batch.padded_prefill is not None) == padded
    out = model.forward_chunks(chunks, together)
    for i, c in enumerate(chunks):
        torch.testing.assert_close(out[i], model.forward_chunks([c], alone)[0], atol=ATOL, rtol=RTOL)
    # The states and KV written by the batched pass carry on like the per-sequence ones.
    step = [SeqChunk(c.slot, [9], c.start_pos + len(c.token_ids)) for c in chunks]
    torch.testing.assert_close(model.forward_chunks(step, together), model.forward_chunks(step, alone), atol=ATOL, rtol=RTOL)


def _native_and_torch_logits(model: HybridModel) -> dict[bool, torch.Tensor]:
    """Prefill (padded batch of two) then three batched decode steps, on each path."""
    prompts = [_prompt(40, seed=40), _prompt(23, seed=41)]
    results = {}
    for mode in (False, True):
        model.use_native_kernels(mode)
        assert model.native_kernels is mode
        cache = model.new_cache(num_slots=2)
        steps = [model.forward_chunks([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], cache)]
        for t in range(3):
            steps.append(model.forward_chunks([SeqChunk(i, [65 + t], len(p) + t) for i, p in enumerate(prompts)], cache))
        results[mode] = torch.stack(steps)
    model.use_native_kernels(False)
    return results


class _GemmOperandWatch(TorchFunctionMode):
    """Records, for every matmul-like torch call that takes one of the watched weights,
    whether its other operand holds bf16 values."""

    FUNCS = frozenset({torch.matmul, torch.mm, torch.bmm, torch.addmm, F.linear, torch.Tensor.__matmul__})

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.calls: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in self.FUNCS and any(t.untyped_storage().data_ptr() in self.storages for t in tensors):
            others = [t for t in tensors if t.untyped_storage().data_ptr() not in self.storages and t.dim() >= 2]  # (not a bias)
            self.calls.append(all(torch.equal(t, t.to(torch.bfloat16).float()) for t in others))
        return func(*args, **(kwargs or {}))


def test_bf16_torch_path_feeds_every_gemm_bf16_values() -> None:
    """The torch path is the bf16 reference: each projection / expert / low-rank GEMM must
    see bf16 values on both sides (the native kernels round inside, tested per kernel).
    Comparing whole-model logits instead would compare two bf16 roundings of fp32 sums
    taken in different orders, which part ways after a few layers."""
    model = HybridModel(HybridConfig.preset("tiny", dtype="bfloat16"))
    weights = [p for name, p in model.named_parameters()
               if name.endswith(("proj.weight", "w_gate_up", "w_down", "low_rank_up")) and "router" not in name]
    assert all(torch.equal(w, w.to(torch.bfloat16).float()) for w in weights)
    watch = _GemmOperandWatch(weights)
    cache = model.new_cache(num_slots=2)
    with watch:
        model.forward_chunks([SeqChunk(0, _prompt(20, seed=70), 0), SeqChunk(1, _prompt(9, seed=71), 0)], cache)
        model.forward_chunks([SeqChunk(0, [5], 20), SeqChunk(1, [6], 9)], cache)
    assert len(watch.calls) >= 2 * 4 * 3 and all(watch.calls), watch.calls  # 2 steps x 4 layers x >= 3 GEMMs


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_native_kernels_give_torch_logits(preset: str) -> None:
    """Prefill (padded batch of two) then batched decode: native vs torch, fp32 rounding apart."""
    if not cpu_kernels.available():
        pytest.skip(f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")
    model = HybridModel(HybridConfig.preset(preset))
    results = _native_and_torch_logits(model)
    torch.testing.assert_close(results[True], results[False], atol=ATOL, rtol=RTOL)
    assert all(m.packed is None for m in model.modules() if hasattr(m, "packed"))  # switched back off


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decoder_is_the_module_path_bit_for_bit(dtype: str) -> None:
    """Decode-only steps take the one-call-per-block native decoder; the module path (what
    prefill and mixed steps run) uses the same kernels in the same order, so the logits
    and the caches are equal bit for bit: the path a step takes never changes a token."""
    if not cpu_kernels.available():
        pytest.skip(f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")
    model = HybridModel(HybridConfig.preset("tiny", dtype=dtype))
    model.use_native_kernels(True)
    decoder = model.native_decoder
    # Scattered slots out of order; the one-token prompt's first step is a decode at
    # position 0 (a fresh state).
    prompts = [_prompt(n, seed=50 + n) for n in (9, 21, 14, 1)]
    slots = [4, 0, 2, 3]
    out, caches = {}, {}
    for name in ("decoder", "modules"):
        model.native_decoder = decoder if name == "decoder" else None
        cache = model.new_cache(num_slots=5)
        for slot, p in zip(slots, prompts, strict=True):
            model.forward_chunks([SeqChunk(slot, p, 0)], cache)
        steps, tokens = [], [3, 70, 200, 9]
        for t in range(4):
            logits = model.forward_chunks([SeqChunk(s, [tok], len(p) + t) for s, tok, p in zip(slots, tokens, prompts, strict=True)],
                                          cache)
            steps.append(logits)
            tokens = logits.argmax(-1).tolist()
        out[name], caches[name] = torch.stack(steps), cache
    model.native_decoder = decoder
    assert torch.equal(out["decoder"], out["modules"])
    for layer, states in caches["decoder"].states.items():
        assert torch.equal(states, caches["modules"].states[layer])
    for layer, keys in caches["decoder"].keys.items():
        assert torch.equal(keys, caches["modules"].keys[layer])
        assert torch.equal(caches["decoder"].values[layer], caches["modules"].values[layer])


def test_native_decoder_goes_with_the_native_kernels() -> None:
    if not cpu_kernels.available():
        pytest.skip(f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")
    model = HybridModel(HybridConfig.preset("tiny"))
    model.use_native_kernels(True)
    assert model.native_decoder is not None
    model.use_native_kernels(False)
    assert model.native_decoder is None  # it points into the packed weights, which are gone


def test_bf16_rounds_the_gemm_weights_only_and_moves_the_logits_a_little() -> None:
    fp32, bf16 = HybridModel(HybridConfig.preset("tiny")), HybridModel(HybridConfig.preset("tiny", dtype="bfloat16"))
    for name, p in bf16.named_parameters():
        rounded = torch.equal(p, p.to(torch.bfloat16).float())
        gemm_weight = name.endswith(("proj.weight", "w_gate_up", "w_down", "low_rank_up"))
        assert rounded == gemm_weight or not gemm_weight, name  # every GEMM weight is a bf16 value
        if "router" in name or "norm" in name or name.startswith("embed"):
            assert torch.equal(p, dict(fp32.named_parameters())[name]), name  # these stay fp32, untouched
    ids = _prompt(30, seed=60)
    logits = [m.forward_chunks([SeqChunk(0, ids, 0)], m.new_cache(1))[0] for m in (fp32, bf16)]
    diff = (logits[0] - logits[1]).abs().max().item()
    assert 1e-4 < diff < 0.1, diff  # bf16 operands: about 2^-9 relative per GEMM, not a different model
