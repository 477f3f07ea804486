"""The bf16 GEMMs against float64 on bf16-rounded operands, and the whole-block decode
kernels (KDA layer, attention layer, router) against the per-kernel compositions."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from refstack.kernels import (
    cpu_attention,
    cpu_blocks,
    cpu_build,
    cpu_kda,
    cpu_kernels,
    cpu_moe,
)
from refstack.model.attention import apply_rope, rope_tables
from refstack.model.moe import route

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")

BF16 = torch.bfloat16


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _bf(t: torch.Tensor) -> torch.Tensor:
    """The value a bf16 operand has: rounded to nearest even, widened exactly."""
    return t.to(BF16).double()


@pytest.mark.parametrize("k,n", [(64, 8), (512, 900), (256, 512), (33, 47)])
@pytest.mark.parametrize("m", [0, 1, 5, 8, 9, 64])
def test_bf16_gemm_is_an_fp32_sum_of_bf16_products(k: int, n: int, m: int) -> None:
    w = _rand(k, n, seed=1, scale=k**-0.5)
    x = _rand(m, k, seed=2)
    got = cpu_kernels.gemm(x, cpu_kernels.pack(w, BF16), n)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # bf16 x bf16 products are exact in fp32: only the fp32 summation order differs.
    torch.testing.assert_close(got, (_bf(x) @ _bf(w)).float(), rtol=1e-5, atol=1e-5)
    if m:  # and it is not the fp32 product: the rounding is real
        assert (got - x @ w).abs().max() > 1e-4


def test_bf16_gemm_rows_do_not_depend_on_their_neighbours() -> None:
    w = cpu_kernels.pack(_rand(512, 900, seed=3, scale=512**-0.5), BF16)
    x = _rand(37, 512, seed=4)
    full = cpu_kernels.gemm(x, w, 900)
    for i in (0, 7, 8, 36):
        assert torch.equal(cpu_kernels.gemm(x[i : i + 1], w, 900), full[i : i + 1])
    assert torch.equal(cpu_kernels.gemm(x[5:22], w, 900), full[5:22])


def _ulp_bf16(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values around |t| (8 significant bits)."""
    return torch.ldexp(torch.ones_like(t), torch.frexp(t.abs().clamp_min(1e-30))[1] - 8)


@pytest.mark.parametrize("counts", [[3, 0, 9, 1, 0, 0, 17, 2], [0] * 8, [8] * 8])
def test_bf16_moe_experts_round_rows_and_hidden_to_bf16(counts: list[int]) -> None:
    E, D, inner = 8, 64, 32
    w_gate_up, w_down = _rand(E, D, 2 * inner, seed=5, scale=D**-0.5), _rand(E, inner, D, seed=6, scale=inner**-0.5)
    rows = _rand(sum(counts), D, seed=7)
    got = cpu_moe.moe_experts(rows, counts, cpu_kernels.pack_gate_up(w_gate_up, BF16), cpu_kernels.pack_down(w_down, BF16))
    out, slack, start = [], [], 0
    for e, c in enumerate(counts):
        gate, up = (_bf(rows[start : start + c]) @ _bf(w_gate_up[e])).chunk(2, dim=-1)
        hidden = F.silu(gate) * up  # exact here; the kernel's is fp32, then rounded to bf16
        out.append(_bf(hidden.float()) @ _bf(w_down[e]))
        # A hidden value within fp32 noise of a bf16 rounding midpoint may round either
        # way in the kernel: allow one bf16 step for exactly those values, nothing else.
        lo, hi = _bf((hidden * (1 - 1e-6)).float()), _bf((hidden * (1 + 1e-6)).float())
        either_way = (lo != hi).double() * _ulp_bf16(hidden)
        slack.append(either_way @ _bf(w_down[e]).abs())
        start += c
    ref, extra = torch.cat(out), torch.cat(slack)
    assert ((got.double() - ref).abs() <= 1e-5 + 1e-5 * ref.abs() + extra).all()


def test_mixed_dtype_packs_are_refused() -> None:
    gate_up = cpu_kernels.pack_gate_up(_rand(2, 64, 64, seed=8), BF16)
    down = cpu_kernels.pack_down(_rand(2, 32, 64, seed=9))
    with pytest.raises(ValueError, match="must both be 5-d of one dtype"):
        cpu_moe.moe_experts(_rand(3, 64, seed=10), [1, 2], gate_up, down)
    with pytest.raises(ValueError, match=r"gemm: x \(2, 66\) does not fit"):
        cpu_kernels.gemm(_rand(2, 66, seed=11), cpu_kernels.pack(_rand(64, 32, seed=12), BF16), 32)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_kda_decode_block_is_the_per_kernel_composition_bit_for_bit(dtype: torch.dtype) -> None:
    B, D, H, K, V, rank = 5, 64, 4, 16, 16, 16
    n_in, n_up = 2 * H * K + H * V + H + 2 * rank, H * K + H * V
    w_in, w_low, w_o = _rand(D, n_in, seed=20, scale=D**-0.5), _rand(2 * rank, n_up, seed=21, scale=0.2), _rand(H * V, D, seed=22, scale=0.1)
    dt_bias, a_log, o_norm = _rand(H * K, seed=23, scale=0.5), _rand(H, seed=24, scale=0.3), 1 + 0.1 * _rand(V, seed=25)
    h, state = _rand(B, D, seed=26), _rand(B, H, K, V, seed=27, scale=0.1)
    packed = [cpu_kernels.pack(w, dtype) for w in (w_in, w_low, w_o)]
    s_block, s_steps = state.clone(), state.clone()
    got = cpu_blocks.kda_decode_block(h, packed[0], packed[1], dt_bias, a_log, s_block, o_norm, 1e-6, packed[2], K**-0.5, 1e-12)
    proj = cpu_kernels.gemm(h, packed[0], n_in)
    up = cpu_kernels.gemm(proj[:, -2 * rank :], packed[1], n_up)
    q, k, v, g, beta = cpu_kda.kda_prepare(proj, up, dt_bias, a_log, H, K, V, K**-0.5, 1e-12)
    o = cpu_kda.kda_decode(q, k, v, g, beta, s_steps, K**-0.5)
    o = cpu_kernels.rms_norm(o, o_norm, 1e-6, gate=up[:, H * K :].reshape(B, H, V).contiguous())
    assert torch.equal(got, cpu_kernels.gemm(o.reshape(B, H * V), packed[2], D))
    assert torch.equal(s_block, s_steps)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_attn_decode_block_matches_projection_rope_attention_projection(dtype: torch.dtype) -> None:
    B, D, Hq, Hkv, hd, slots_n, max_len = 3, 64, 4, 2, 16, 4, 40
    w_qkv, w_o = _rand(D, (Hq + 2 * Hkv) * hd, seed=30, scale=D**-0.5), _rand(Hq * hd, D, seed=31, scale=0.1)
    qkv_p, o_p = cpu_kernels.pack(w_qkv, dtype), cpu_kernels.pack(w_o, dtype)
    cos, sin = rope_tables(hd, max_len, 10000.0)
    keys, values = _rand(slots_n, Hkv, max_len, hd, seed=32), _rand(slots_n, Hkv, max_len, hd, seed=33)
    slots, positions = torch.tensor([2, 0, 3]), torch.tensor([5, 0, 39])
    h = _rand(B, D, seed=34)
    k_ref, v_ref = keys.clone(), values.clone()
    got = cpu_blocks.attn_decode_block(h, qkv_p, o_p, Hq, Hkv, hd, cos, sin, keys, values, slots, positions, hd**-0.5)
    qkv = cpu_kernels.gemm(h, qkv_p, (Hq + 2 * Hkv) * hd)
    qk = apply_rope(qkv[:, : (Hq + Hkv) * hd].reshape(B, Hq + Hkv, hd), cos[positions], sin[positions])
    v = qkv[:, (Hq + Hkv) * hd :].reshape(B, Hkv, hd)
    att = cpu_attention.gqa_decode(qk[:, :Hq].contiguous(), qk[:, Hq:].contiguous(), v.contiguous(), k_ref, v_ref, slots, positions,
                                 hd**-0.5)
    torch.testing.assert_close(got, cpu_kernels.gemm(att.reshape(B, Hq * hd), o_p, D), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, k_ref, rtol=1e-6, atol=1e-6)  # the same rows written, nothing else
    assert torch.equal(values, v_ref)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 40\)"):
        cpu_blocks.attn_decode_block(h, qkv_p, o_p, Hq, Hkv, hd, cos, sin, keys, values, slots, torch.tensor([5, 0, 40]), 1.0)


def test_moe_route_picks_the_torch_experts_and_weights() -> None:
    logits = _rand(64, 8, seed=40)
    ids, weights = cpu_blocks.moe_route(logits, 2)
    ref_ids, ref_weights = route(logits, 2)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    tied = torch.zeros(1, 4)
    assert cpu_blocks.moe_route(tied, 2)[0].tolist() == [[0, 1]]  # ties go to the lower id
    with pytest.raises(ValueError, match="moe_route"):
        cpu_blocks.moe_route(logits, 9)


def _bf16_results() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(33, 47, generator=g) * 0.2, torch.randn(9, 33, generator=g)
    w_gate_up, w_down = torch.randn(4, 64, 64, generator=g) * 0.125, torch.randn(4, 32, 64, generator=g) * 0.18
    rows, counts = torch.randn(13, 64, generator=g), [5, 0, 7, 1]
    return {
        "gemm": cpu_kernels.gemm(x, cpu_kernels.pack(w, BF16), 47),
        "experts": cpu_moe.moe_experts(rows, counts, cpu_kernels.pack_gate_up(w_gate_up, BF16),
                                           cpu_kernels.pack_down(w_down, BF16)),
    }


_FALLBACK = """
import sys, torch
from refstack.kernels import cpu_build
cpu_build.FLAGS = (*cpu_build.FLAGS, "-mno-avx512bf16")  # as on a CPU without AVX512_BF16
sys.path.insert(0, sys.argv[1])
from test_cpu_bf16_and_blocks import _bf16_results
from refstack.engine.config import resolve_dtype
from refstack.kernels import cpu_kernels
# Without the instruction the build says so, and dtype=auto stays float32.
assert not cpu_kernels.bf16_dot_native() and resolve_dtype("auto", "auto") == "float32"
torch.save(_bf16_results(), sys.argv[2])
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512bf16 is an x86 flag")
def test_bf16_kernels_without_the_bf16_dot_product_instruction_give_the_same_bits(tmp_path: Path) -> None:
    """The portable path (bf16 pairs widened to fp32, added in vdpbf16ps's order) gives the
    same sums as this build, bit for bit (no denormals here)."""
    env = {**os.environ, "REFSTACK_KERNEL_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "fallback.pt"
    r = subprocess.run([sys.executable, "-c", _FALLBACK, str(Path(__file__).parent), str(out)], capture_output=True,
                       text=True, env=env, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    fallback, here = torch.load(out), _bf16_results()
    for name in here:
        assert torch.equal(fallback[name], here[name]), name


def test_the_bf16_dot_product_probe_says_what_the_compiler_built() -> None:
    """dtype=auto rests on this probe: a build that targets AVX512_BF16 must report it
    (and the -mno-avx512bf16 build above must not)."""
    cc = cpu_build._compiler()
    macros = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                            text=True, timeout=60, check=True).stdout
    assert cpu_kernels.bf16_dot_native() == ("__AVX512BF16__" in macros)


def test_kda_decode_block_finds_each_state_by_slot() -> None:
    B, D, H, K, V, rank = 3, 64, 4, 16, 16, 16
    n_in, n_up = 2 * H * K + H * V + H + 2 * rank, H * K + H * V
    packed = [cpu_kernels.pack(_rand(*shape, seed=60 + i, scale=0.1)) for i, shape in
              enumerate([(D, n_in), (2 * rank, n_up), (H * V, D)])]
    dt_bias, a_log, o_norm = _rand(H * K, seed=64, scale=0.5), _rand(H, seed=65, scale=0.3), torch.ones(V)
    h, states = _rand(B, D, seed=66), _rand(5, H, K, V, seed=67, scale=0.1)
    slots = torch.tensor([4, 0, 2])
    gathered = states[slots].clone()
    by_slot = cpu_blocks.kda_decode_block(h, packed[0], packed[1], dt_bias, a_log, states, o_norm, 1e-6, packed[2], 0.25,
                                          1e-12, slots=slots)
    dense = cpu_blocks.kda_decode_block(h, packed[0], packed[1], dt_bias, a_log, gathered, o_norm, 1e-6, packed[2], 0.25, 1e-12)
    assert torch.equal(by_slot, dense)
    assert torch.equal(states[slots], gathered)  # the slots' states advanced exactly as the dense ones
    with pytest.raises(ValueError, match="distinct indices"):
        cpu_blocks.kda_decode_block(h, packed[0], packed[1], dt_bias, a_log, states, o_norm, 1e-6, packed[2], 0.25, 1e-12,
                                    slots=torch.tensor([1, 1, 2]))
