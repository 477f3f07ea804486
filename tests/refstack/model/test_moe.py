"""Expert-parallel dispatch + combine equals every token run through its experts directly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from refstack.kernels import cpu_kernels
from refstack.model import HybridConfig
from refstack.model.moe import MoE, combine, dispatch, route, swiglu_experts


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    ids, weights = route(x @ moe.router.weight.T, moe.top_k)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            e = int(ids[t, j])
            gate, up = (x[t] @ moe.w_gate_up[e]).chunk(2)
            y[t] += weights[t, j] * ((F.silu(gate) * up) @ moe.w_down[e])
    return y


NATIVE = pytest.mark.skipif(not cpu_kernels.available(), reason=f"native kernels unavailable: {cpu_kernels.unavailable_reason()}")
LAYOUTS = ["grouped", "padded", "auto", pytest.param("native", marks=NATIVE)]


def _moe(**overrides) -> MoE:
    cfg = HybridConfig.preset("tiny", **overrides)
    return MoE(cfg, layer=0, gen=torch.Generator().manual_seed(11))


def _with_layout(moe: MoE, layout: str) -> MoE:
    if layout == "native":  # native dispatch, experts and combine
        moe.use_native(True)
    else:
        moe.dispatch_layout = layout
    return moe


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_matches_dense_reference(layout: str) -> None:
    moe = _with_layout(_moe(), layout)
    x = torch.randn(37, moe.w_gate_up.shape[1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), _dense_reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_matches_dense_reference_with_one_token_and_one_rank(layout: str) -> None:
    moe = _with_layout(_moe(ep_ranks=1, num_experts_per_tok=3), layout)
    x = torch.randn(1, moe.w_gate_up.shape[1], generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(moe(x), _dense_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_dispatch_gives_each_rank_only_its_experts_tokens() -> None:
    E, ranks, k, T, D = 8, 4, 2, 20, 6
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1)
    d = dispatch(x, ids, weights, num_experts=E, ep_ranks=ranks, layout="grouped")
    assert len(d.buffers) == ranks
    assert sum(d.counts) == T * k
    per = E // ranks
    start = 0
    for r, buf in enumerate(d.buffers):
        local = range(r * per, (r + 1) * per)
        expected = [(t, e) for e in local for t in range(T) if e in ids[t].tolist()]  # grouped by expert
        assert buf.shape[0] == len(expected)
        for row, (t, _e) in enumerate(expected):
            assert int(d.token_ids[start + row]) == t
            torch.testing.assert_close(buf[row], x[t], rtol=0, atol=0)
        start += buf.shape[0]
    # Identity experts: combine must give back sum_j w_tj * x_t = x_t (weights sum to 1).
    y = combine([b.clone() for b in d.buffers], d)
    torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)
    padded = dispatch(x, ids, weights, num_experts=E, ep_ranks=ranks, layout="padded")
    assert all(b.shape[:2] == (per, max(d.counts)) for b in padded.buffers)
    torch.testing.assert_close(combine([b.clone() for b in padded.buffers], padded), x, rtol=1e-6, atol=1e-6)
    if cpu_kernels.available():  # the native counting sort groups exactly as the stable argsort does
        native = dispatch(x, ids, weights, num_experts=E, ep_ranks=ranks, layout="native")
        assert native.counts == d.counts and torch.equal(native.token_ids, d.token_ids)
        assert torch.equal(native.weights, d.weights) and torch.equal(native.copy_slot, d.copy_slot)
        assert all(torch.equal(a, b) for a, b in zip(native.buffers, d.buffers, strict=True))
        torch.testing.assert_close(combine([b.clone() for b in native.buffers], native), x, rtol=1e-6, atol=1e-6)


def test_route_is_renormalised_top_k_of_the_softmax() -> None:
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(4))
    ids, weights = route(logits, 3)
    probs = torch.softmax(logits, dim=-1)
    top, top_ids = probs.topk(3, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))


def test_swiglu_experts_skips_idle_experts() -> None:
    D, inner = 4, 3
    gen = torch.Generator().manual_seed(5)
    w_gu = torch.randn(3, D, 2 * inner, generator=gen)
    w_d = torch.randn(3, inner, D, generator=gen)
    w_gu[1] = float("nan")  # an idle expert's weights must never be touched
    buf = torch.randn(3, D, generator=gen)
    out = swiglu_experts(buf, [2, 0, 1], w_gu, w_d)
    assert torch.isfinite(out).all()
    gate, up = (buf[2] @ w_gu[2]).chunk(2)
    torch.testing.assert_close(out[2], (F.silu(gate) * up) @ w_d[2])


def test_auto_layout_pads_only_busy_experts_with_several_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe()  # 8 experts, top-2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert moe.layout_for(1) == "grouped"  # few copies: idle experts' weights stay unread
    assert moe.layout_for(8) == "padded"  # 16 copies over 8 experts
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert moe.layout_for(64) == "grouped"  # one thread: the batched GEMM has nothing to split
