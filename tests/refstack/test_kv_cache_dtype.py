"""KV cache and KDA state precision (``--kv-cache-dtype``, ``--kv-cache-dtype-layers``,
``--kda-state-dtype``): storage, kernels, quality, and the server's report and refusals.

Quality bounds (``test_quantized_caches_stay_close_to_the_fp32_cache``): the tiny model
prefills three prompts, then decodes 32 tokens teacher-forced on the fp32 cache's greedy
tokens, so every position compares the same context.  Measured on this box (torch and
native paths alike, the numbers agree to 1e-6):

    cache          KL mean   KL max    greedy-token |dlogprob| max
    bf16 KV        6.0e-08   4.3e-07   0.001
    fp8_e4m3 KV    8.7e-05   7.7e-03   0.127
    int8 KV        8.4e-05   8.1e-03   0.091
    bf16 state     9.4e-07   3.7e-06   0.005
    (bf16 GEMMs    2.4e-04   1.5e-02   0.091: the --dtype bfloat16 model, for scale)

The bounds are ~5x the measurements: room for another CPU's rounding (the MoE router
is a discrete choice a small difference can flip at one position, which is where the
max comes from), tight enough that a wrong scale, a lost scale or a mis-decoded byte
(each moves KL by orders of magnitude: a missing V scale is KL ~1) fails.  int8 / fp8
also stay within the bf16-GEMM model's own distance from fp32, which the project
already accepts for ``--dtype auto``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from refstack.engine import Engine, EngineConfig, SamplingParams
from refstack.engine.device import PlacementError, resolve_placement
from refstack.kernels import cpu_attention, cpu_kernels
from refstack.model import ByteTokenizer, HybridConfig, HybridModel, SeqChunk
from refstack.model.cache import HEADROOM, QMAX, KVCodec, calibrate_kv_amax
from refstack.model.kv_dtypes import (
    footprint,
    parse_kv_cache_dtype_layers,
    resolve_kv_dtypes,
)

TOK = ByteTokenizer()
TINY = HybridConfig.preset("tiny")  # attention layers 1 and 3, KDA layers 0 and 2
PROMPTS = [list(b"hello world, this is a test of the cache " * 2), list(b"another prompt here!"),
           list(b"def f(x):\n    return x * 2\n" * 3)]
STEPS = 32
KV_TYPES = ("bf16", "fp8_e4m3", "int8")
# name: (KL mean, KL max, greedy-token |dlogprob| max): see the module docstring.
BOUNDS = {"bf16": (1e-6, 5e-6, 0.01), "fp8_e4m3": (5e-4, 0.04, 0.5), "int8": (5e-4, 0.04, 0.5),
          "state_bf16": (1e-5, 5e-5, 0.03)}
native = pytest.mark.skipif(not cpu_kernels.available(), reason="native CPU kernels unavailable")


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(TINY)


def _all(kv: str) -> dict[int, str]:
    return {layer: kv for layer in TINY.full_attention_layers}


# ---- the knobs: parsing, refusals, footprint -----------------------------------------------

@pytest.mark.parametrize(("spec", "words"), [
    ("0:bf16", ["entry '0:bf16'", "layer 0 is a KDA layer, not an attention layer", "attention layers are 1, 3"]),
    ("7:int8", ["entry '7:int8'", "unknown layer index 7", "layers 0..3"]),
    ("1:fp16", ["entry '1:fp16'", "unknown dtype 'fp16'", "auto, fp32, bf16, fp8_e4m3, int8"]),
    ("1", ["entry '1' is not LAYER:DTYPE"]),
    ("one:int8", ["entry 'one:int8'", "layer 'one' is not an integer"]),
    ("1:int8, 1:bf16", ["entry '1:bf16'", "layer 1 is given twice"]),
])
def test_bad_layer_overrides_are_one_line_naming_the_knob_and_entry(spec: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        parse_kv_cache_dtype_layers(spec, TINY)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--kv-cache-dtype-layers {spec!r}: "), line
    assert all(w in line for w in words), line


def test_layer_overrides_resolve_over_the_default() -> None:
    assert resolve_kv_dtypes("auto", "", TINY) == {1: "fp32", 3: "fp32"}
    assert resolve_kv_dtypes("int8", " 3:bf16 ", TINY) == {1: "int8", 3: "bf16"}
    assert resolve_kv_dtypes("fp8_e4m3", "1:auto", TINY) == {1: "fp32", 3: "fp8_e4m3"}


def test_fp8_without_float8_types_and_a_quantized_cache_with_disagg_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlacementError, match=r"^--kv-cache-dtype int8 with --disagg: .*fp32 bytes"):
        resolve_placement(EngineConfig(kv_cache_dtype="int8"), disagg=True)
    with pytest.raises(PlacementError, match=r"^--kda-state-dtype bf16 with --disagg"):
        resolve_placement(EngineConfig(kda_state_dtype="bf16"), disagg=True)
    resolve_placement(EngineConfig(kv_cache_dtype="int8", kv_cache_dtype_layers="1:fp32,3:fp32"), disagg=True)  # all fp32
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(PlacementError) as err:
        resolve_placement(EngineConfig(kv_cache_dtype_layers="3:fp8_e4m3"))
    assert str(err.value).startswith("--kv-cache-dtype-layers 3:fp8_e4m3: this torch") and "float8_e4m3fn" in str(err.value)
    resolve_placement(EngineConfig(kv_cache_dtype="int8"))  # the other types need no float8


@pytest.mark.parametrize(("preset", "fp32_token", "fp32_state"), [("tiny", 512, 8192), ("small", 2048, 393216)])
def test_bytes_per_token_and_per_sequence(preset: str, fp32_token: int, fp32_state: int) -> None:
    """tiny: 2 attention layers x K,V x 2 KV heads x 16 dims; 2 KDA layers of 4 x 16 x 16.
    small: 2 attention layers x K,V x 2 x 64; 6 KDA layers of 4 x 64 x 64."""
    config = HybridConfig.preset(preset)
    attn = config.full_attention_layers
    for kv, per_elem in (("fp32", 4), ("bf16", 2), ("fp8_e4m3", 1), ("int8", 1)):
        fp = footprint(config, {layer: kv for layer in attn}, "fp32", config.max_seq_len)
        assert fp["kv_bytes_per_token"] == fp32_token * per_elem // 4 and fp["kv_bytes_per_token_fp32"] == fp32_token
        assert fp["bytes_per_sequence"] == fp["kv_bytes_per_token"] * config.max_seq_len + fp32_state
        assert fp["sequences_per_gib"] == (1 << 30) // fp["bytes_per_sequence"]
    assert footprint(config, {}, "bf16", 1)["kda_state_bytes_per_sequence"] == fp32_state // 2
    mixed = footprint(config, {attn[0]: "int8", attn[1]: "bf16"}, "fp32", 1)["kv_bytes_per_token"]
    assert mixed == fp32_token // 8 + fp32_token // 4  # half the layers at 1 byte, half at 2
    cache = HybridModel(TINY).new_cache(2, kv_dtypes={1: "int8", 3: "bf16"}, state_dtype="bf16") if preset == "tiny" else None
    if cache is not None:  # what the cache allocates agrees (plus 2 x 2 scales of layer 1)
        fp = cache.footprint()
        assert cache.nbytes == 2 * (fp["kv_bytes_per_token"] * TINY.max_seq_len + fp["kda_state_bytes_per_sequence"]) + 16


# ---- storage and kernels -------------------------------------------------------------------

def test_caches_store_the_chosen_types_with_per_head_scales(model: HybridModel) -> None:
    cache = model.new_cache(2, kv_dtypes={1: "fp8_e4m3", 3: "int8"}, state_dtype="bf16")
    assert (cache.keys[1].dtype, cache.keys[3].dtype) == (torch.float8_e4m3fn, torch.int8)
    assert all(s.dtype == torch.bfloat16 for s in cache.states.values())
    amax = calibrate_kv_amax(model)
    for layer, name in ((1, "fp8_e4m3"), (3, "int8")):
        assert cache.k_scales[layer].shape == cache.v_scales[layer].shape == (TINY.num_kv_heads,)
        torch.testing.assert_close(cache.k_scales[layer], amax[layer][0] * HEADROOM[name] / QMAX[name])
    assert calibrate_kv_amax(model) is amax  # once per model


@native
def test_the_native_kernel_stores_the_bytes_torch_stores() -> None:
    """Rounding ties, subnormals and saturation: gqa_decode's writer against KVCodec.encode."""
    f8 = torch.float8_e4m3fn
    grid = torch.arange(256, dtype=torch.uint8).view(f8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([grid, ties, -ties, torch.arange(-130.5, 130.5, 0.5), torch.tensor([449.0, 464.0, 1e4, -1e4, -0.0]),
                   torch.randn(3000, generator=gen) * 50, torch.randn(3000, generator=gen) * 0.01])
    x = x[: x.numel() // 16 * 16].view(-1, 1, 16)
    B = x.shape[0]
    for name in KV_TYPES:
        scale = torch.ones(1)
        keys = torch.zeros(B, 1, 1, 16, dtype={"bf16": torch.bfloat16, "fp8_e4m3": f8, "int8": torch.int8}[name])
        values = torch.zeros_like(keys)
        scales = {} if name == "bf16" else {"k_scale": scale, "v_scale": scale}
        cpu_attention.gqa_decode(torch.zeros(B, 1, 16), x, x, keys, values, torch.arange(B), torch.zeros(B, dtype=torch.long),
                               1.0, **scales)
        want = KVCodec(name, scale, scale).encode(x, 0)
        got = keys[:, :, 0]
        got = got.view(torch.uint8) if name == "fp8_e4m3" else got.view(torch.int16) if name == "bf16" else got
        want = want.view(torch.int16) if name == "bf16" else want
        assert torch.equal(got, want), name


@native
@pytest.mark.parametrize("name", KV_TYPES)
@pytest.mark.parametrize("D", [16, 64, 24])  # 24: the scalar path
def test_native_decode_attention_reads_the_quantized_cache(name: str, D: int) -> None:
    gen = torch.Generator().manual_seed(D)
    S, Hkv, group, L = 3, 2, 3, 150
    ref = torch.randn(S, Hkv, L, D, generator=gen) * 2
    scale = ref.abs().amax(dim=(0, 2, 3)) / 100 if name != "bf16" else torch.ones(Hkv)
    codec = KVCodec(name, scale, scale * 0.5)
    kq, vq = (codec.encode(ref.transpose(1, 2), w).transpose(1, 2).contiguous() for w in (0, 1))
    if name == "fp8_e4m3":
        kq, vq = kq.view(torch.float8_e4m3fn), vq.view(torch.float8_e4m3fn)
    slots, pos = torch.tensor([2, 0]), torch.tensor([149, 70])
    q = torch.randn(2, Hkv * group, D, generator=gen)
    k_new, v_new = torch.randn(2, Hkv, D, generator=gen), torch.randn(2, Hkv, D, generator=gen)
    scales = {} if name == "bf16" else {"k_scale": codec.k_scale, "v_scale": codec.v_scale}
    out = cpu_attention.gqa_decode(q, k_new, v_new, kq, vq, slots, pos, D**-0.5, **scales)
    raw = (lambda t: t.view(torch.uint8)) if name == "fp8_e4m3" else (lambda t: t)
    for b in range(2):  # the torch path's arithmetic: decode what is stored, attend in fp32
        s, p = int(slots[b]), int(pos[b])
        k = codec.decode(raw(kq)[s, :, : p + 1], 0)
        v = codec.decode(raw(vq)[s, :, : p + 1], 1)
        torch.testing.assert_close(k[:, p], codec.decode(codec.encode(k_new[b], 0).unsqueeze(1), 0)[:, 0])
        att = torch.softmax(q[b].view(Hkv, group, D) @ k.transpose(-1, -2) * D**-0.5, dim=-1) @ v
        torch.testing.assert_close(out[b], att.reshape(Hkv * group, D), atol=2e-5, rtol=1e-4)


@native
def test_native_decoder_is_the_module_path_bit_for_bit_over_quantized_caches() -> None:
    """The one-call-per-block decoder and the module path share the kernels, with any
    storage: logits and every cache byte agree (bf16 state rows gathered, stepped, rounded)."""
    m = HybridModel(TINY)
    m.use_native_kernels(True)
    decoder = m.native_decoder
    out, caches = {}, {}
    for name in ("decoder", "modules"):
        m.native_decoder = decoder if name == "decoder" else None
        cache = m.new_cache(5, kv_dtypes={1: "fp8_e4m3", 3: "int8"}, state_dtype="bf16")
        slots = [4, 0, 2]
        for slot, p in zip(slots, PROMPTS, strict=True):
            m.forward_chunks([SeqChunk(slot, p, 0)], cache)
        tokens, steps = [3, 70, 200], []
        for t in range(4):
            logits = m.forward_chunks([SeqChunk(s, [tok], len(p) + t) for s, tok, p in zip(slots, tokens, PROMPTS)], cache)
            steps.append(logits)
            tokens = logits.argmax(-1).tolist()
        out[name], caches[name] = torch.stack(steps), cache
    m.native_decoder = decoder
    assert torch.equal(out["decoder"], out["modules"])
    for layer in caches["decoder"].keys:
        for kind in ("keys", "values"):
            a, b = getattr(caches["decoder"], kind)[layer], getattr(caches["modules"], kind)[layer]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (kind, layer)
    for layer, states in caches["decoder"].states.items():
        assert torch.equal(states, caches["modules"].states[layer])


def test_a_prompt_attends_to_the_stored_keys_in_one_chunk_or_several(model: HybridModel) -> None:
    """Every read decodes what was stored (the chunk's own keys too), so chunking a prefill
    changes nothing, on a quantized cache as on fp32."""
    prompt = PROMPTS[0]
    whole = model.new_cache(1, kv_dtypes=_all("int8"))
    once = model.forward_chunks([SeqChunk(0, prompt, 0)], whole)
    split = model.new_cache(1, kv_dtypes=_all("int8"))
    model.forward_chunks([SeqChunk(0, prompt[:30], 0)], split)
    twice = model.forward_chunks([SeqChunk(0, prompt[30:], 30)], split)
    torch.testing.assert_close(twice, once, atol=1e-5, rtol=1e-5)
    for layer in whole.keys:
        assert torch.equal(whole.keys[layer], split.keys[layer]) and torch.equal(whole.values[layer], split.values[layer])


# ---- quality and greedy decoding ------------------------------------------------------------

def _teacher_forced(m: HybridModel, kv: dict[int, str] | None, state: str, reference: torch.Tensor | None) -> torch.Tensor:
    """Logits after the prompts and after each of STEPS decode steps; the tokens fed are the
    reference's greedy ones (its own when there is no reference)."""
    cache = m.new_cache(len(PROMPTS), kv_dtypes=kv, state_dtype=state)
    out = [m.forward_chunks([SeqChunk(i, p, 0) for i, p in enumerate(PROMPTS)], cache)]
    for t in range(STEPS):
        toks = (reference[t] if reference is not None else out[t]).argmax(-1).tolist()
        out.append(m.forward_chunks([SeqChunk(i, [toks[i]], len(p) + t) for i, p in enumerate(PROMPTS)], cache))
    return torch.stack(out)


@pytest.mark.parametrize("path", ["torch", pytest.param("native", marks=native)])
def test_quantized_caches_stay_close_to_the_fp32_cache(path: str) -> None:
    m = HybridModel(TINY)
    m.use_native_kernels(path == "native")
    reference = _teacher_forced(m, None, "fp32", None)
    lr = reference.log_softmax(-1)
    greedy = lr.argmax(-1, keepdim=True)
    for name, kv, state in [*((n, _all(n), "fp32") for n in KV_TYPES), ("state_bf16", None, "bf16")]:
        lp = _teacher_forced(m, kv, state, reference).log_softmax(-1)
        kl = (lr.exp() * (lr - lp)).sum(-1)
        d_greedy = (lp.gather(-1, greedy) - lr.gather(-1, greedy)).abs().max().item()
        kl_mean, kl_max, d_max = BOUNDS[name]
        assert kl.mean() <= kl_mean and kl.max() <= kl_max and d_greedy <= d_max, \
            f"{name}: KL mean {kl.mean():.2e} max {kl.max():.2e}, greedy |dlogprob| {d_greedy:.3f} (bounds {BOUNDS[name]})"


@pytest.mark.parametrize("knobs", [
    {"kv_cache_dtype": "bf16"}, {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "int8"},
    {"kv_cache_dtype": "int8", "kv_cache_dtype_layers": "3:bf16", "kda_state_dtype": "bf16"},
    {"kv_cache_dtype": "fp8_e4m3", "cpu_kernels": "torch"},
])
def test_greedy_decoding_runs_with_every_cache(model: HybridModel, knobs: dict[str, Any]) -> None:
    """Batched greedy generation through the engine (chunked prefill, mixed steps, the
    native decoder where it builds); bf16 storage keeps every fp32 greedy token here, and
    the scaled types at least agree with fp32 on most of them."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [TOK.encode(p, add_bos=True) for p in ("The quick brown fox", "Hi", "x" * 40)]

    def run(**kw: Any) -> list[list[int]]:
        engine = Engine(EngineConfig(preset="tiny", max_batch_tokens=24, prefill_chunk=7, **kw), model=model, tokenizer=TOK)
        return [o.token_ids for o in engine.generate(prompts, params)]

    fp32 = run(cpu_kernels=knobs.get("cpu_kernels", "auto"))
    got = run(**knobs)
    assert all(len(t) == 16 for t in got)
    same = sum(a == b for x, y in zip(fp32, got) for a, b in zip(x, y)) / sum(map(len, fp32))
    assert same == 1.0 if knobs == {"kv_cache_dtype": "bf16"} else same >= 0.75, (same, got, fp32)


# ---- the server ------------------------------------------------------------------------------

def test_serve_a_mixed_cache_and_report_it(refstack_server_factory: Callable[..., Any]) -> None:
    server = refstack_server_factory(args=["--kv-cache-dtype", "int8", "--kv-cache-dtype-layers", "3:bf16",
                                           "--kda-state-dtype", "bf16"])
    body = {"prompt": "Mixed caches", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
    cache = httpx.get(server.url + "/debug/engine", timeout=10).json()["cache"]
    assert cache["kv_dtypes"] == {"1": "int8", "3": "bf16"} and cache["kda_state_dtype"] == "bf16"
    # per token: layer 1 int8 (2 x 2 heads x 16 x 1 B) + layer 3 bf16 (x 2 B); states: 2 layers x 4 x 16 x 16 x 2 B
    assert (cache["kv_bytes_per_token"], cache["kv_bytes_per_token_fp32"], cache["kda_state_bytes_per_sequence"]) == \
        (64 + 128, 512, 4096)
    assert cache["bytes_per_sequence"] == 192 * 512 + 4096 and cache["sequences_per_gib"] == (1 << 30) // (192 * 512 + 4096)
    lines = [ln for ln in server.log().splitlines() if ln.startswith("refstack cache: ")]
    want = ("refstack cache: KV cache mixed 1:int8,3:bf16 192 B/token (fp32: 512), KDA state bf16 4096 B/sequence, "
            f"{192 * 512 + 4096} B per 512-token sequence, {cache['sequences_per_gib']} sequences per GiB")
    assert lines == [want], server.log()


@pytest.mark.parametrize(("args", "words"), [
    (["--kv-cache-dtype-layers", "0:int8"], ["--kv-cache-dtype-layers '0:int8'", "layer 0 is a KDA layer",
                                             "preset tiny", "attention layers are 1, 3"]),
    (["--kv-cache-dtype", "fp8_e4m3", "--disagg", "true"], ["--kv-cache-dtype fp8_e4m3 with --disagg"]),
])
def test_serve_refuses_a_combination_in_one_line(args: list[str], words: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "refstack.cli", "serve", "--port", "0", *args], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode != 0 and "refstack serving" not in r.stdout, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refstack: error: "), r.stderr
    assert all(w in lines[0] for w in words), lines[0]


# ---- GPU (skipped without CUDA) ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kv", KV_TYPES)
def test_quantized_caches_on_cuda_store_their_types_and_stay_as_close_as_on_the_cpu(kv: str) -> None:
    """The tiny model on CUDA (torch's path) with a bf16 / fp8 / int8 KV cache: the cache holds
    the chosen storage type on the device (fp8 as float8_e4m3fn), with its per-(layer, head)
    scales, and its teacher-forced logits stay within the CPU bounds (``BOUNDS``) of the CPU's
    fp32-cache reference."""
    cpu = HybridModel(TINY)
    reference = _teacher_forced(cpu, None, "fp32", None)
    gpu = HybridModel(TINY).to("cuda")
    cache = gpu.new_cache(len(PROMPTS), kv_dtypes=_all(kv))
    want = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}[kv]
    for layer in TINY.full_attention_layers:
        assert cache.keys[layer].device.type == "cuda" and cache.keys[layer].dtype == want
        assert cache.values[layer].dtype == want
        if kv != "bf16":
            assert cache.k_scales[layer].shape == (TINY.num_kv_heads,) and bool((cache.k_scales[layer] > 0).all())
    lr = reference.log_softmax(-1)
    lp = _teacher_forced(gpu, _all(kv), "fp32", reference).float().cpu().log_softmax(-1)
    kl = (lr.exp() * (lr - lp)).sum(-1)
    greedy = lr.argmax(-1, keepdim=True)
    d_greedy = (lp.gather(-1, greedy) - lr.gather(-1, greedy)).abs().max().item()
    kl_mean, kl_max, d_max = BOUNDS[kv]
    assert kl.mean() <= kl_mean and kl.max() <= kl_max and d_greedy <= d_max, \
        f"{kv} on cuda: KL mean {kl.mean():.2e} max {kl.max():.2e}, greedy |dlogprob| {d_greedy:.3f} (bounds {BOUNDS[kv]})"
