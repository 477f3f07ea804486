"""Tensor-parallel kernels against the unpartitioned computation (N ranks simulated)."""

from __future__ import annotations

import pytest
import torch

from refstack.kernels import tp
from refstack.kernels.precision import matmul

FP32_LEVEL = 3e-6  # the tp-numerics spec's partition tolerance (relative Frobenius)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture(scope="module")
def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    T, H, V = 256, 1024, 2048
    return {
        "o": torch.randn(T, H, generator=g),
        "w_o": torch.randn(H, H, generator=g) * H**-0.5,
        "w_lm": torch.randn(V, H, generator=g) * H**-0.5,
    }


def test_ring_all_reduce_is_a_sum_in_rotated_order() -> None:
    parts = [torch.randn(7, 5) for _ in range(3)]
    for order in tp.REDUCE_ORDERS:
        torch.testing.assert_close(tp.all_reduce_sum(parts, order), parts[0] + parts[1] + parts[2])
    # Exactly the rotated association for chunk 1 of a 3-way ring: (p1 + p2) + p0.
    flat = [p.reshape(-1) for p in parts]
    sl = slice(12, 24)  # 35 elements over 3 ranks: chunks of 12, 12, 11
    ring = tp.all_reduce_sum(parts, "ring").reshape(-1)[sl]
    assert torch.equal(ring, (flat[1][sl] + flat[2][sl]) + flat[0][sl])
    with pytest.raises(ValueError):
        tp.all_reduce_sum(parts, "tree")


@pytest.mark.parametrize("world", [2, 3, 8])
def test_vocab_parallel_head_is_the_same_computation(model: dict[str, torch.Tensor], world: int) -> None:
    h, w = model["o"][:64], model["w_lm"][:1000]  # 1000 % 3 != 0: uneven vocab slices
    for precision in ("fp32", "tf32", "3xtf32"):
        ref = matmul(h, w.t(), precision)
        logits, logprobs = tp.vocab_parallel_head(h, w, world, precision)
        # Each rank's GEMM, gathered in rank order: nothing recomputed or reordered.
        per_rank = torch.cat([matmul(h, w_r.t(), precision) for w_r in tp.shard(w, world, dim=0)], -1)
        assert torch.equal(logits, per_rank)
        # And each logit is still one full-length dot product (no split-K): against the
        # unpartitioned GEMM it is bitwise equal on most hosts, but a BLAS may pick another
        # micro-kernel for a narrower slice (a 16-core host with one thread per test
        # worker did at 125 columns), so the check is the partition tolerance.
        assert _rel(logits, ref) < FP32_LEVEL, precision
        torch.testing.assert_close(logprobs, torch.log_softmax(ref, -1), rtol=1e-6, atol=1e-5)
        assert torch.equal(tp.vocab_parallel_argmax(h, w, world, precision), per_rank.argmax(-1))


def test_vocab_parallel_argmax_breaks_ties_to_the_lowest_index() -> None:
    h = torch.ones(1, 4)
    w = torch.zeros(6, 4)
    w[1] = w[4] = 1.0  # equal maxima on rank 0 and rank 1 (TP=2)
    assert tp.vocab_parallel_argmax(h, w, 2).tolist() == [1]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_row_parallel_equals_unpartitioned_to_fp32_level(model: dict[str, torch.Tensor], world: int) -> None:
    o, w = model["o"], model["w_o"]
    for precision in ("fp32", "tf32", "3xtf32"):
        got = tp.row_parallel_linear(o, w, world, precision)
        assert _rel(got, matmul(o, w.t(), precision)) < FP32_LEVEL, precision


def test_tf32_after_split_k_diverges_and_3xtf32_restores(model: dict[str, torch.Tensor]) -> None:
    """Row-parallel o_proj feeding the LM head: reordering changes ulps of the hidden
    state; TF32 truncation in the LM head turns some into 2**-10 jumps; 3xTF32 does not."""
    o, w_o, w_lm = model["o"], model["w_o"], model["w_lm"]
    diff = {}
    for precision in ("fp32", "tf32", "3xtf32"):
        ref = matmul(matmul(o, w_o.t(), precision), w_lm.t(), precision)
        got = tp.vocab_parallel_logits(tp.row_parallel_linear(o, w_o, 4, precision), w_lm, 4, precision)
        diff[precision] = _rel(got, ref)
    assert diff["fp32"] < FP32_LEVEL
    assert diff["tf32"] > FP32_LEVEL            # beyond fp32 tolerance (measured, ~1e-5)
    assert diff["3xtf32"] < FP32_LEVEL
    assert diff["tf32"] > 5 * diff["3xtf32"]


def test_kda_column_then_row_parallel_matches_dense(model: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(1)
    T, D, heads, dk = 32, 128, 8, 16
    x = torch.randn(T, D, generator=g)
    weights = {n: torch.randn(heads * dk, D, generator=g) * D**-0.5 for n in ("q", "k", "v", "g")}
    w_o = torch.randn(D, heads * dk, generator=g) * (heads * dk) ** -0.5
    per_rank = tp.kda_projections_tp(x, weights, heads, 4)
    for name, w in weights.items():
        torch.testing.assert_close(torch.cat([r[name] for r in per_rank], -1), x @ w.t())
    # Stand-in for the per-head recurrence: any per-rank function of the rank's heads.
    o_per_rank = [torch.tanh(r["q"] * r["v"]) for r in per_rank]
    dense = torch.cat(o_per_rank, -1) @ w_o.t()
    assert _rel(tp.kda_output_tp(o_per_rank, w_o, 4), dense) < FP32_LEVEL
    with pytest.raises(ValueError, match="whole heads"):
        tp.kda_projections_tp(x, weights, heads, 3)
