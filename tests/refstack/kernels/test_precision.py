"""Precision emulation: what TF32 truncation keeps, and how much 3xTF32 recovers."""

from __future__ import annotations

import pytest
import torch

from refstack.kernels.precision import PRECISIONS, matmul, split_tf32, tf32_truncate


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_tf32_truncation_keeps_ten_mantissa_bits() -> None:
    x = torch.randn(4096) * 100
    t = tf32_truncate(x)
    bits = t.view(torch.int32)
    assert torch.all(bits & 0x1FFF == 0)                     # low 13 mantissa bits cleared
    assert torch.all((x.view(torch.int32) ^ bits) & ~0x1FFF == 0)  # sign, exponent, top 10 kept
    assert torch.all(t.abs() <= x.abs())                     # truncation: toward zero
    assert torch.all((x - t).abs() <= x.abs() * 2.0**-10)
    one = torch.tensor([1.0 + 2.0**-10, 1.0 + 2.0**-11])     # representable / not
    assert tf32_truncate(one).tolist() == [1.0 + 2.0**-10, 1.0]


def test_split_is_nearly_exact_and_parts_are_tf32() -> None:
    x = torch.randn(10000)
    big, small = split_tf32(x)
    assert torch.equal(tf32_truncate(big), big) and torch.equal(tf32_truncate(small), small)
    assert torch.all((big + small - x).abs() <= x.abs() * 2.0**-20)
    assert torch.all(small.abs() <= x.abs() * 2.0**-10)


@pytest.mark.parametrize("k", [256, 4096])
def test_error_ladder_against_fp64(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    a = torch.randn(64, k, generator=g)
    b = torch.randn(k, 48, generator=g)
    ref = a.double() @ b.double()
    err = {p: _rel(matmul(a, b, p), ref) for p in PRECISIONS}
    assert err["fp32"] < 1e-6
    assert 1e-4 < err["tf32"] < 2e-3          # ~2**-10 relative per input, truncated
    assert err["3xtf32"] < 1e-6
    assert err["3xtf32"] < err["tf32"] / 300  # 3xTF32 recovers (almost) fp32
    assert 1e-3 < err["bf16"] < 1e-2


def test_matmul_accepts_batched_activations_and_returns_fp32() -> None:
    a = torch.randn(2, 3, 16, dtype=torch.float64)
    b = torch.randn(16, 5)
    out = matmul(a, b, "3xtf32")
    assert out.shape == (2, 3, 5) and out.dtype == torch.float32


def test_matmul_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="precision"):
        matmul(torch.zeros(2, 3), torch.zeros(3, 4), "fp8")
    with pytest.raises(ValueError, match="matmul needs"):
        matmul(torch.zeros(2, 3), torch.zeros(4, 4))
