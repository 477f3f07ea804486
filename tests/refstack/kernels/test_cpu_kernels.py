"""The native CPU kernels against torch (fp32 rounding apart), their batch invariance,
their input checks, and the build's failure modes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from refstack.kernels import cpu_attention, cpu_build, cpu_kda, cpu_kernels, cpu_moe
from refstack.model.kda_ops import kda_chunked, kda_naive, kda_recurrent_step

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("k,n", [(64, 8), (64, 228), (512, 900), (256, 512), (33, 47)])
@pytest.mark.parametrize("m", [0, 1, 5, 8, 9, 31, 64])
def test_gemm_matches_float64_reference(k: int, n: int, m: int) -> None:
    w = _rand(k, n, seed=1, scale=k**-0.5)  # model-like scale: outputs of order 1
    x = _rand(m, k, seed=2)
    got = cpu_kernels.gemm(x, cpu_kernels.pack(w), n)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, (x.double() @ w.double()).float(), rtol=1e-5, atol=1e-5)


def test_gemm_rows_do_not_depend_on_their_neighbours() -> None:
    w = cpu_kernels.pack(_rand(512, 900, seed=3, scale=512**-0.5))
    x = _rand(37, 512, seed=4)
    full = cpu_kernels.gemm(x, w, 900)
    for i in (0, 7, 8, 36):  # first/last rows of register tiles, and the ragged tail
        assert torch.equal(cpu_kernels.gemm(x[i : i + 1], w, 900), full[i : i + 1])
    assert torch.equal(cpu_kernels.gemm(x[5:22], w, 900), full[5:22])


def test_gemm_reads_strided_rows() -> None:
    w = _rand(64, 96, seed=5)
    wide = _rand(6, 200, seed=6)
    x = wide[:, 10:74]  # row stride 200, columns contiguous
    assert x.stride() == (200, 1)
    torch.testing.assert_close(cpu_kernels.gemm(x, cpu_kernels.pack(w), 96), x @ w, rtol=1e-5, atol=1e-5)


def _experts_reference(rows: torch.Tensor, counts: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for e, c in enumerate(counts):
        gate, up = (rows[start : start + c].double() @ w_gate_up[e].double()).chunk(2, dim=-1)
        out.append((F.silu(gate) * up) @ w_down[e].double())
        start += c
    return torch.cat(out).float()


@pytest.mark.parametrize("counts", [[3, 0, 9, 1, 0, 0, 17, 2], [0] * 8, [1, 0, 0, 0, 0, 0, 0, 0], [8] * 8])
def test_moe_experts_match_per_expert_swiglu(counts: list[int]) -> None:
    E, D, inner = 8, 96, 48  # D not a multiple of the 32-column block: the ragged tail
    w_gate_up = _rand(E, D, 2 * inner, seed=7, scale=D**-0.5)
    w_down = _rand(E, inner, D, seed=8, scale=inner**-0.5)
    rows = _rand(sum(counts), D, seed=9)
    got = cpu_moe.moe_experts(rows, counts, cpu_kernels.pack_gate_up(w_gate_up), cpu_kernels.pack_down(w_down))
    assert got.shape == rows.shape
    if rows.shape[0]:
        torch.testing.assert_close(got, _experts_reference(rows, counts, w_gate_up, w_down), rtol=1e-5, atol=1e-5)


def test_rms_norm_plain_fused_residual_and_gated() -> None:
    x, w, delta, gate = _rand(7, 3, 64, seed=10), _rand(64, seed=11), _rand(7, 3, 64, seed=12), _rand(7, 3, 64, seed=13)
    ref = F.rms_norm(x, (64,), w, 1e-6)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cpu_kernels.rms_norm(x, w, 1e-6, gate=gate), ref * torch.sigmoid(gate), rtol=1e-5, atol=1e-6)
    stream = x.clone()
    got = cpu_kernels.rms_norm(stream, w, 1e-6, residual_delta=delta)
    torch.testing.assert_close(stream, x + delta, rtol=0, atol=0)  # the residual add is written back
    torch.testing.assert_close(got, F.rms_norm(x + delta, (64,), w, 1e-6), rtol=1e-5, atol=1e-6)


def test_nan_and_extreme_gates_behave_as_in_torch() -> None:
    x, w = _rand(2, 32, seed=80), _rand(32, seed=81)
    gate = torch.tensor([float("nan"), 200.0, -200.0, 88.0, -88.0, 0.0, 1e-30, -1e-30] * 8).view(2, 32)
    got = cpu_kernels.rms_norm(x, w, 1e-6, gate=gate)
    ref = F.rms_norm(x, (32,), w, 1e-6) * torch.sigmoid(gate)
    assert torch.equal(got.isnan(), ref.isnan())
    torch.testing.assert_close(got.nan_to_num(), ref.nan_to_num(), rtol=1e-5, atol=1e-30)


def test_kda_decode_matches_the_torch_step() -> None:
    B, H, K, V = 5, 4, 64, 32
    q, k = F.normalize(_rand(B, H, K, seed=14), dim=-1), F.normalize(_rand(B, H, K, seed=15), dim=-1)
    v, beta = _rand(B, H, V, seed=16), torch.sigmoid(_rand(B, H, seed=17))
    g = -torch.rand(B, H, K, generator=torch.Generator().manual_seed(18)) * 0.2
    state = _rand(B, H, K, V, seed=19)
    o_ref, s_ref = kda_recurrent_step(q, k, v, g, beta, state.clone(), 0.125)
    s = state.clone()
    o = cpu_kda.kda_decode(q, k, v, g, beta, s, 0.125)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


def test_kda_prepare_matches_the_torch_activations() -> None:
    T, H, K, V = 7, 4, 16, 8
    width = 2 * H * K + H * V + H + 2 * V
    proj = _rand(T, width + 5, seed=60, scale=3.0)[:, :width]  # strided rows, as a slice of a wider buffer
    up = _rand(T, H * K + H * V, seed=61, scale=12.0)  # f spans softplus's whole range, both tails
    dt_bias, a_log = _rand(H * K, seed=62), _rand(H, seed=63, scale=0.5)
    q, k, v, g, beta = cpu_kda.kda_prepare(proj, up, dt_bias, a_log, H, K, V, K**-0.5, 1e-12)
    qk = F.rms_norm(proj[:, : 2 * H * K].reshape(T, 2 * H, K), (K,), torch.full((K,), K**-0.5), 1e-12)
    torch.testing.assert_close(torch.cat([q, k], dim=1), qk, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, proj[:, 2 * H * K : 2 * H * K + H * V].reshape(T, H, V), rtol=0, atol=0)
    g_ref = F.softplus(up[:, : H * K] + dt_bias).reshape(T, H, K) * -torch.exp(a_log).view(H, 1)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, torch.sigmoid(proj[:, 2 * H * K + H * V : 2 * H * K + H * V + H]), rtol=1e-5, atol=1e-7)


def test_kda_scan_matches_the_reference_recurrence_and_the_chunked_form() -> None:
    B, T, H, K, V = 3, 37, 2, 32, 16
    q, k = F.normalize(_rand(B, T, H, K, seed=30), dim=-1), F.normalize(_rand(B, T, H, K, seed=31), dim=-1)
    v, beta = _rand(B, T, H, V, seed=32), torch.sigmoid(_rand(B, T, H, seed=33))
    g = -torch.rand(B, T, H, K, generator=torch.Generator().manual_seed(34)) * 0.3
    init = _rand(B, H, K, V, seed=35, scale=0.1)
    state = init.clone()
    o = cpu_kda.kda_scan(q, k, v, g, beta, state, 0.2)
    o_chunk, s_chunk = kda_chunked(q, k, v, g, beta, init, 0.2, 16)
    for b in range(B):
        o_ref, s_ref = kda_naive(q[b], k[b], v[b], g[b], beta[b], init[b], 0.2)
        torch.testing.assert_close(o[b], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[b], s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o, o_chunk, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s_chunk, rtol=1e-5, atol=1e-5)


def test_kda_scan_padding_leaves_the_state_alone_and_rows_are_independent() -> None:
    B, T, H, K, V = 2, 9, 2, 16, 16
    q, k = F.normalize(_rand(B, T, H, K, seed=40), dim=-1), F.normalize(_rand(B, T, H, K, seed=41), dim=-1)
    v, beta = _rand(B, T, H, V, seed=42), torch.sigmoid(_rand(B, T, H, seed=43))
    g = -torch.rand(B, T, H, K, generator=torch.Generator().manual_seed(44)) * 0.3
    k[1, 5:], g[1, 5:] = 0.0, 0.0  # sequence 1 is 5 tokens long, padded to 9
    state = _rand(B, H, K, V, seed=45, scale=0.1)
    alone = state[1:].clone()
    o = cpu_kda.kda_scan(q, k, v, g, beta, state, 0.25)
    o_alone = cpu_kda.kda_scan(q[1:, :5], k[1:, :5], v[1:, :5], g[1:, :5], beta[1:, :5], alone, 0.25)
    assert torch.equal(state[1:], alone) and torch.equal(o[1:, :5], o_alone)


@pytest.mark.parametrize("KV", [(64, 64), (16, 32)])  # a specialised scan, and the generic one
def test_kda_scan_varlen_runs_each_sequence_from_its_slot(KV: tuple[int, int]) -> None:
    """A mixed step: two decode tokens, a fresh prefill, a continued one (one row covered
    by none); each sequence must match the reference recurrence from its own state."""
    K, V = KV
    N, H, num_slots = 16, 2, 6
    q, k = F.normalize(_rand(N, H, K, seed=70), dim=-1), F.normalize(_rand(N, H, K, seed=71), dim=-1)
    v, beta = _rand(N, H, V, seed=72), torch.sigmoid(_rand(N, H, seed=73))
    g = -torch.rand(N, H, K, generator=torch.Generator().manual_seed(74)) * 0.3
    states = _rand(num_slots, H, K, V, seed=75, scale=0.1)
    before = states.clone()
    seqs = [(0, 1, 4, False), (1, 1, 0, True), (2, 7, 2, True), (9, 6, 5, False)]  # (begin, length, slot, fresh)
    begins, lengths, slots = (torch.tensor([s[i] for s in seqs]) for i in range(3))
    fresh = torch.tensor([s[3] for s in seqs])
    o = cpu_kda.kda_scan_varlen(q, k, v, g, beta, states, begins, lengths, slots, fresh, 0.3)
    for begin, n, slot, is_fresh in seqs:
        r = slice(begin, begin + n)
        init = torch.zeros_like(before[slot]) if is_fresh else before[slot]
        o_ref, s_ref = kda_naive(q[r], k[r], v[r], g[r], beta[r], init, 0.3)
        torch.testing.assert_close(o[r], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slot], s_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(o[15], torch.zeros(H, V))  # no sequence covers row 15
    assert torch.equal(states[[1, 3]], before[[1, 3]])  # slots no sequence names
    bad = [  # (begins, lengths, slots)
        ([0, 1, 2, 9], [1, 1, 7, 8], [4, 0, 2, 5]),  # rows past the end
        ([0, 1, 2, 9], [1, 1, 7, 6], [4, 0, 2, 6]),  # a slot past the cache
        ([0, 1, 2, 9], [1, 1, 7, 6], [4, 0, 2, 4]),  # a repeated slot: two tasks on one state
        ([0, 1, 2, 8], [1, 1, 7, 6], [4, 0, 2, 5]),  # overlapping rows: two tasks on one output row
        ([0, 1, 2, 2**62], [1, 1, 7, 2**62], [4, 0, 2, 5]),  # begin + length overflows int64
    ]
    for bad_begins, bad_lengths, bad_slots in bad:
        with pytest.raises(ValueError, match="rejected the sequences"):
            cpu_kda.kda_scan_varlen(q, k, v, g, beta, states, torch.tensor(bad_begins), torch.tensor(bad_lengths),
                                        torch.tensor(bad_slots), fresh, 0.3)


def test_kda_scan_varlen_gives_kda_scans_bits_on_equal_lengths() -> None:
    B, T, H, K, V = 3, 11, 2, 64, 64
    q, k = F.normalize(_rand(B, T, H, K, seed=80), dim=-1), F.normalize(_rand(B, T, H, K, seed=81), dim=-1)
    v, beta = _rand(B, T, H, V, seed=82), torch.sigmoid(_rand(B, T, H, seed=83))
    g = -torch.rand(B, T, H, K, generator=torch.Generator().manual_seed(84)) * 0.3
    dense, by_slot = _rand(B, H, K, V, seed=85, scale=0.1), torch.zeros(5, H, K, V)
    slots = torch.tensor([4, 0, 2])
    by_slot[slots] = dense
    o = cpu_kda.kda_scan(q, k, v, g, beta, dense, 0.125)
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o_var = cpu_kda.kda_scan_varlen(*flat, by_slot, torch.arange(B) * T, torch.full((B,), T), slots,
                                        torch.zeros(B, dtype=torch.bool), 0.125)
    assert torch.equal(o_var.view(B, T, H, V), o) and torch.equal(by_slot[slots], dense)


# D = 20 takes the scalar path (not a multiple of 16); positions 15-17 end and start a key block.
@pytest.mark.parametrize("D", [32, 64, 20])
@pytest.mark.parametrize("pos", [(0, 70, 199), (15, 16, 17)])
def test_gqa_decode_writes_the_cache_and_attends_over_each_sequence_length(D: int, pos: tuple[int, ...]) -> None:
    slots_n, Hkv, group, max_len = 5, 2, 3, 200
    keys, values = _rand(slots_n, Hkv, max_len, D, seed=50), _rand(slots_n, Hkv, max_len, D, seed=51)
    slots, positions = torch.tensor([3, 0, 4]), torch.tensor(pos)  # e.g. a fresh sequence, one block, many
    B = 3
    q, k_new, v_new = _rand(B, Hkv * group, D, seed=52), _rand(B, Hkv, D, seed=53), _rand(B, Hkv, D, seed=54)
    ref_keys, ref_values = keys.clone(), values.clone()
    out = cpu_attention.gqa_decode(q, k_new, v_new, keys, values, slots, positions, D**-0.5)
    for b in range(B):
        s, p = int(slots[b]), int(positions[b])
        ref_keys[s, :, p], ref_values[s, :, p] = k_new[b], v_new[b]
        k_ctx = ref_keys[s, :, : p + 1].repeat_interleave(group, dim=0)  # [Hq, L, D]
        v_ctx = ref_values[s, :, : p + 1].repeat_interleave(group, dim=0)
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), k_ctx, v_ctx).squeeze(1)
        torch.testing.assert_close(out[b], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)  # written in place, nothing else touched


def test_bad_inputs_raise_value_errors_that_name_the_kernel() -> None:
    w = cpu_kernels.pack(_rand(64, 64, seed=20))
    with pytest.raises(ValueError, match="gemm: the native kernels take fp32"):
        cpu_kernels.gemm(_rand(2, 64, seed=21).double(), w, 64)
    with pytest.raises(ValueError, match=r"gemm: x \(2, 63\)"):
        cpu_kernels.gemm(_rand(2, 63, seed=21), w, 64)
    with pytest.raises(ValueError, match="moe_experts"):
        cpu_moe.moe_experts(_rand(3, 64, seed=22), [1, 1], cpu_kernels.pack_gate_up(_rand(2, 64, 64, seed=23)),
                                cpu_kernels.pack_down(_rand(2, 32, 64, seed=24)))
    with pytest.raises(ValueError, match=r"moe_dispatch: expert ids must be in \[0, 4\)"):
        cpu_moe.moe_dispatch(_rand(2, 8, seed=27), torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="moe_combine"):
        cpu_moe.moe_combine(_rand(4, 8, seed=28), torch.tensor([[0, 4]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"gqa_decode: positions must be in \[0, 8\)"):
        cache = torch.zeros(2, 1, 8, 4)
        cpu_attention.gqa_decode(torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), cache, cache.clone(),
                               torch.tensor([1]), torch.tensor([8]), 1.0)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        cpu_kernels.pack_gate_up(_rand(2, 64, 2 * 24, seed=25))
    with pytest.raises(ValueError, match="state is updated in place"):
        s = _rand(2, 4, 16, 16, seed=26).transpose(2, 3)
        cpu_kda.kda_decode(*(_rand(2, 4, 16, seed=s_) for s_ in (1, 2, 3)), _rand(2, 4, 16, seed=4), _rand(2, 4, seed=5), s, 1.0)


def test_wrappers_stop_what_the_c_code_cannot_take() -> None:
    w = cpu_kernels.pack(_rand(64, 64, seed=70))
    with pytest.raises(ValueError, match=r"fp32 \[\.\.\., K, 32\] or bf16"):
        cpu_kernels.gemm(_rand(2, 64, seed=71), w[..., :16].contiguous(), 64)
    gate_up, down = cpu_kernels.pack_gate_up(_rand(2, 64, 64, seed=72)), cpu_kernels.pack_down(_rand(2, 32, 64, seed=73))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_moe.moe_experts(_rand(3, 64, seed=74), [1, 2], gate_up.transpose(0, 1).contiguous().transpose(0, 1), down)
    with pytest.raises(ValueError, match="index tensors must be int64 on the CPU"):
        cpu_moe.moe_dispatch(_rand(2, 8, seed=75), torch.zeros(2, 2, dtype=torch.int64, device="meta"), torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="index tensors must be int64 on the CPU"):
        cpu_moe.moe_combine(_rand(4, 8, seed=76), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2))
    cache = torch.zeros(2, 1, 8, 4)
    with pytest.raises(ValueError, match="index tensors must be int64 on the CPU"):
        cpu_attention.gqa_decode(torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), cache, cache.clone(),
                               torch.tensor([1], device="meta"), torch.tensor([0]), 1.0)
    empty = cpu_attention.gqa_decode(torch.zeros(0, 2, 4), torch.zeros(0, 1, 4), torch.zeros(0, 1, 4), cache, cache.clone(),
                                   torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 1.0)
    assert empty.shape == (0, 2, 4)


def test_gemm_takes_rows_with_unusual_strides() -> None:
    w = _rand(64, 32, seed=77)
    one = torch.randn(64, 1, generator=torch.Generator().manual_seed(78)).t()  # contiguous, strides (1, 1)
    torch.testing.assert_close(cpu_kernels.gemm(one, cpu_kernels.pack(w), 32), one @ w, rtol=1e-5, atol=1e-5)
    expanded = _rand(1, 64, seed=79).expand(3, 64)  # row stride 0
    torch.testing.assert_close(cpu_kernels.gemm(expanded, cpu_kernels.pack(w), 32), expanded @ w, rtol=1e-5, atol=1e-5)


def test_build_is_cached_per_source_compiler_and_cpu(tmp_path: Path) -> None:
    first = cpu_build.build(tmp_path)
    assert first.stat().st_mode & 0o777 == 0o755 & ~cpu_build._umask()  # loadable by other users of a shared cache
    stamp = first.stat().st_mtime_ns
    again = cpu_build.build(tmp_path)
    assert again == first and again.stat().st_mtime_ns == stamp  # not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cpu_kernels-")]  # no temp file left


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_build.NativeKernelsUnavailable, match="no C compiler"):
        cpu_build.build(tmp_path / "cache")


def test_failing_compiler_reports_its_output_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake-cc 1.0; exit 0; }\necho 'fatal: no openmp here' >&2\nexit 4\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(cpu_build.NativeKernelsUnavailable, match=r"failed to build the kernels \(exit 4\): fatal: no openmp here"):
        cpu_build.build(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []


def test_the_kernel_lab_example_spec_passes_and_catches_a_batch_dependent_gemm() -> None:
    """examples/cpu-kernels/spec.py through the kernel lab: every kernel and variant passes,
    and a GEMM whose rows depend on the batch fails the bit-exact rows_split check."""
    from infra_agent.lab.correctness import check_spec
    from infra_agent.lab.loader import load_specs

    specs = {s.name: s for s in load_specs(Path(__file__).parents[3] / "examples" / "cpu-kernels" / "spec.py")}
    assert set(specs) == {"decode_gemm", "moe_experts", "kda_scan", "decode_gemm_bf16"}
    for spec in specs.values():
        report = check_spec(spec, seeds=[5], device="cpu")
        assert report.passed, [r.to_dict() for r in report.failures]
        assert {r.variant for r in report.results} == {"kernel", *(v.name for v in spec.variants)}
    # A GEMM that picks its algorithm by row count, as BLAS libraries do (here: split-K
    # from 8 rows up), changes a row's rounding with the batch: rows_split catches it.
    import dataclasses

    def by_row_count(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, **_: object) -> torch.Tensor:
        if x.shape[0] < 8:
            return cpu_kernels.gemm(x, packed, w.shape[1])
        return sum(x[:, i::4] @ w[i::4] for i in range(4))  # type: ignore[return-value]

    buggy = dataclasses.replace(specs["decode_gemm"], kernel=by_row_count, variants=[
        dataclasses.replace(specs["decode_gemm"].variant("rows_split"),
                            fn=lambda x, w, packed, **kw: torch.cat([by_row_count(x[: len(x) // 2], w, packed),
                                                                   by_row_count(x[len(x) // 2 :], w, packed)]))])
    report = check_spec(buggy, seeds=[5], device="cpu", variants=["rows_split"])
    assert not report.passed and {r.variant for r in report.failures} == {"rows_split"}
    # 8 rows -> 4 + 4 crosses the switch (whether MKL itself is row-invariant at 32 -> 16 is its business)
    assert {"M=8,K=512,N=512", "M=8,K=512,N=900"} <= {r.shape for r in report.failures}
