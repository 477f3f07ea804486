"""The three forms of the gated delta rule agree: naive, recurrent (decode), chunked (prefill)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from refstack.model.kda_ops import (
    SUB_CHUNK,
    _chunk_factorable,
    _factorable,
    kda_chunked,
    kda_naive,
    kda_recurrent_step,
)


def _inputs(T: int, H: int = 3, K: int = 16, V: int = 8, dtype=torch.float64, decay: float = 1.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = F.normalize(rnd(T, H, K), dim=-1)
    k = F.normalize(rnd(T, H, K), dim=-1)
    v = rnd(T, H, V)
    g = -decay * torch.rand(T, H, K, generator=gen, dtype=dtype)
    beta = torch.rand(T, H, generator=gen, dtype=dtype)
    s0 = rnd(H, K, V)  # a non-zero initial state, as after an earlier prefill chunk
    return q, k, v, g, beta, s0


def _recurrent(q, k, v, g, beta, s0, scale):
    state = s0.unsqueeze(0).clone()
    outs = []
    for t in range(q.shape[0]):
        o, state = kda_recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state, scale)
        outs.append(o[0])
    return torch.stack(outs), state[0]


@pytest.mark.parametrize(
    ("T", "chunk"),
    [(1, 16), (17, 16), (50, 16), (37, 32), (130, 64), (64, 64)],
)
def test_chunked_and_recurrent_match_naive_fp64(T: int, chunk: int) -> None:
    q, k, v, g, beta, s0 = _inputs(T)
    scale = q.shape[-1] ** -0.5
    o_ref, s_ref = kda_naive(q, k, v, g, beta, s0, scale)
    o_chunk, s_chunk = kda_chunked(q, k, v, g, beta, s0, scale, chunk)
    o_rec, s_rec = _recurrent(q, k, v, g, beta, s0, scale)
    for got_o, got_s in ((o_chunk, s_chunk), (o_rec, s_rec)):
        torch.testing.assert_close(got_o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_s, s_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("decay", "path"),
    [
        (1.0, "whole chunk factored"),  # ~e^-0.5 per step: e^-32 over a chunk of 64
        (4.0, "sub-chunks factored"),  # ~e^-2 per step: e^-128 per chunk, e^-32 per sub-chunk
        (20.0, "pairwise"),  # ~e^-10 per step: factoring even a sub-chunk would overflow fp32
    ],
)
def test_chunked_matches_naive_fp32_on_every_decay_path(decay: float, path: str) -> None:
    q, k, v, g, beta, s0 = (x.float() for x in _inputs(100, H=4, K=32, V=16, decay=decay, seed=1))
    C = 64
    G = F.pad(g, (0, 0, 0, 0, 0, 28)).view(2, C, 4, 32).cumsum(1).permute(2, 0, 1, 3)  # [H, 2, C, K] within-chunk decay
    taken = (
        "whole chunk factored" if _chunk_factorable(G)
        else "sub-chunks factored" if _factorable(G.unflatten(-2, (C // SUB_CHUNK, SUB_CHUNK)))
        else "pairwise"
    )
    assert taken == path
    scale = 32**-0.5
    o_ref, s_ref = kda_naive(q, k, v, g, beta, s0, scale)
    o_chunk, s_chunk = kda_chunked(q, k, v, g, beta, s0, scale, C)
    assert torch.isfinite(o_chunk).all() and torch.isfinite(s_chunk).all()
    torch.testing.assert_close(o_chunk, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chunk, s_ref, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_split_in_two_equals_one_pass() -> None:
    q, k, v, g, beta, s0 = _inputs(45)
    scale = 16**-0.5
    o_all, s_all = kda_chunked(q, k, v, g, beta, s0, scale, 16)
    o_a, s_a = kda_chunked(q[:20], k[:20], v[:20], g[:20], beta[:20], s0, scale, 16)
    o_b, s_b = kda_chunked(q[20:], k[20:], v[20:], g[20:], beta[20:], s_a, scale, 16)
    torch.testing.assert_close(torch.cat([o_a, o_b]), o_all, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_b, s_all, rtol=1e-10, atol=1e-10)


def test_batched_recurrent_step_equals_per_sequence_steps() -> None:
    B, H, K, V = 5, 2, 8, 4
    gen = torch.Generator().manual_seed(3)
    q = F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, H, K, generator=gen), dim=-1)
    v = torch.randn(B, H, V, generator=gen)
    g = -torch.rand(B, H, K, generator=gen)
    beta = torch.rand(B, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen)
    o, new = kda_recurrent_step(q, k, v, g, beta, state, 0.5)
    for b in range(B):
        o_b, new_b = kda_naive(q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], state[b], 0.5)
        torch.testing.assert_close(o[b], o_b[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new[b], new_b, rtol=1e-5, atol=1e-6)
    # Not in place unless asked: the input state is untouched.
    o2, _ = kda_recurrent_step(q, k, v, g, beta, state, 0.5)
    torch.testing.assert_close(o2, o, rtol=0, atol=0)


def test_batched_chunked_equals_each_sequence() -> None:
    seqs = [_inputs(40, seed=s) for s in (5, 6, 7)]
    stacked = [torch.stack(parts) for parts in zip(*seqs)]
    o, final = kda_chunked(*stacked[:5], stacked[5], 0.25, 16)
    for i, (q, k, v, g, beta, s0) in enumerate(seqs):
        o_i, final_i = kda_chunked(q, k, v, g, beta, s0, 0.25, 16)
        torch.testing.assert_close(o[i], o_i, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[i], final_i, rtol=1e-10, atol=1e-10)
