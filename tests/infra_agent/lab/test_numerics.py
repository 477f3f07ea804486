from __future__ import annotations

import math

import pytest
import torch

from infra_agent.lab.numerics import (
    Condition,
    compare,
    split_3xtf32,
    tf32_truncate,
    ulp_distance,
)
from infra_agent.lab.spec import Tolerance


def _next_up(x: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, math.inf))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_ulp_one_step_is_one(dtype: torch.dtype) -> None:
    x = torch.tensor([1.0, -3.5, 1e-3, 100.0], dtype=dtype)
    if dtype in (torch.float16, torch.bfloat16):
        # nextafter has no half kernels on the CPU: step the bit pattern instead.
        bits = x.view(torch.int16)
        up = torch.where(x >= 0, bits + 1, bits - 1).view(dtype)
    else:
        up = _next_up(x)
    assert ulp_distance(up, x).tolist() == [1.0] * 4
    assert ulp_distance(x, x).tolist() == [0.0] * 4


def test_ulp_known_distances() -> None:
    # bf16 keeps 7 mantissa bits: 1.0 -> 1.0078125 is one ULP, 1.0 -> 1.03125 is four.
    a = torch.tensor([1.0078125, 1.03125], dtype=torch.bfloat16)
    ref = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert ulp_distance(a, ref).tolist() == [1.0, 4.0]
    # fp32: 2**-23 above 1.0 is one ULP, below 1.0 the spacing halves -> two ULP for -2**-23.
    x = torch.tensor([1.0 + 2**-23, 1.0 - 2**-23], dtype=torch.float32)
    assert ulp_distance(x, torch.ones(2, dtype=torch.float64)).tolist() == [1.0, 2.0]
    # +0 and -0 are the same value; the smallest subnormals either side of 0 are two apart.
    tiny = torch.tensor([2**-149], dtype=torch.float32)
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])).item() == 0.0
    assert ulp_distance(-tiny, tiny).item() == 2.0


def test_ulp_nonfinite() -> None:
    x = torch.tensor([float("nan"), float("inf"), float("inf")])
    r = torch.tensor([1.0, float("inf"), 1.0])
    assert ulp_distance(x, r).tolist() == [math.inf, 0.0, math.inf]


def test_compare_hand_made() -> None:
    ref = torch.tensor([[1.0, 2.0], [4.0, 0.0]], dtype=torch.float64)
    out = torch.tensor([[1.0, 2.5], [4.0, 0.25]], dtype=torch.float32)
    cond = Condition("s", "v", "M=2", "float32", 7, "fp32", "cpu")
    st = compare(out, ref, Tolerance(atol=0.1, rtol=0.0), cond)
    assert st.max_abs == pytest.approx(0.5)
    assert st.max_rel == pytest.approx(0.25)  # 0.5 / 2.0; the zero reference is left out
    assert st.rel_fro == pytest.approx(math.sqrt(0.25 + 0.0625) / math.sqrt(1 + 4 + 16))
    assert st.worst_index == (0, 1) and st.worst_value == 2.5 and st.worst_ref == 2.0
    assert not st.passed and st.n_violations == 2
    assert st.condition is cond and "seed=7" in cond.label()
    # A loose enough tolerance passes; rel_fro alone judges the whole tensor.
    assert compare(out, ref, Tolerance(atol=0.6)).passed
    assert not compare(out, ref, Tolerance(rel_fro=0.1)).passed
    assert compare(out, ref, Tolerance(rel_fro=0.2)).passed


def test_compare_worst_is_furthest_past_tolerance() -> None:
    # With rtol, a small error on a small value can be worse than a bigger one on a big value.
    ref = torch.tensor([1000.0, 0.01])
    out = torch.tensor([1001.0, 0.02])
    st = compare(out, ref, Tolerance(rtol=1e-2))
    assert st.worst_index == (1,)
    assert st.max_abs == pytest.approx(1.0)


def test_compare_nan_fails_regardless_of_tolerance() -> None:
    ref = torch.zeros(5)
    out = torch.zeros(5)
    out[3] = float("nan")
    st = compare(out, ref, Tolerance(rel_fro=1e9, atol=1e9))
    assert not st.passed and st.n_nonfinite == 1 and st.worst_index == (3,)
    assert "non-finite" in st.reason


def test_tf32_truncation_keeps_ten_mantissa_bits() -> None:
    x = torch.tensor([1.0 + 2**-10, 1.0 + 2**-11, 1.0 + 2**-10 + 2**-11, -(1.0 + 2**-11), 3.0])
    got = tf32_truncate(x)
    # Bits below 2**-10 (relative) vanish, toward zero for both signs.
    assert got.tolist() == [1.0 + 2**-10, 1.0, 1.0 + 2**-10, -1.0, 3.0]
    assert (got.view(torch.int32) & 0x1FFF).eq(0).all()
    r = torch.randn(10_000)
    rel = ((r - tf32_truncate(r)) / r).abs()
    assert float(rel.max()) < 2**-10 and float(rel.max()) > 2**-12


def test_3xtf32_split_recovers_about_21_bits() -> None:
    x = torch.randn(10_000)
    big, small = split_3xtf32(x)
    assert torch.equal(big, tf32_truncate(big)) and torch.equal(small, tf32_truncate(small))
    rel = ((x.double() - big.double() - small.double()) / x.double()).abs().max()
    assert float(rel) < 2**-20


def test_violated_names_the_failed_criteria() -> None:
    ref = torch.ones(64, dtype=torch.float64)
    out = ref.clone()
    out[:8] += 1e-3  # small everywhere it moves: elementwise-fine, norm-wise not
    only_norm = compare(out, ref, Tolerance(atol=1e-2, rel_fro=1e-5))
    assert not only_norm.passed and only_norm.violated == ["rel_fro"] and only_norm.n_violations == 0
    both = compare(out, ref, Tolerance(atol=1e-4, rel_fro=1e-5))
    assert both.violated == ["atol/rtol", "rel_fro"] and both.n_violations == 8
    assert compare(ref, ref, Tolerance(rel_fro=1e-5)).violated == []
    assert compare(out, ref, Tolerance(atol=1e-2, rel_fro=1e-5)).to_dict()["violated"] == ["rel_fro"]


def test_max_ulp_leaves_out_references_near_zero() -> None:
    # A GEMM-like result: every element carries an absolute error of about 1e-6, the
    # output's scale times roundoff.  One reference sits at 1e-9 and one result
    # crosses zero: in ULP of their own tiny magnitudes those errors are enormous.
    ref = torch.tensor([3.0, -2.0, 1.5, 1e-9, -1e-10, 4.0], dtype=torch.float64)
    out = (ref + torch.tensor([1e-6, -1e-6, 1e-6, 1e-6, 2e-10, 0.0], dtype=torch.float64)).float()
    st = compare(out, ref, Tolerance(rel_fro=1e-5))
    assert st.max_ulp_all > 1e6  # every element, as before
    rms = float(ref.pow(2).mean().sqrt())
    assert st.ulp_floor == pytest.approx(1e-2 * rms)  # DEFAULT_ULP_FLOOR x RMS
    assert 1 <= st.max_ulp <= 16  # over |ref| >= the floor: ULP at the output's scale
    # The ulp criterion judges the elements the figure covers ...
    assert compare(out, ref, Tolerance(ulp=16)).passed
    failing = compare(out, ref, Tolerance(ulp=1))
    assert failing.violated == ["ulp"] and f"over elements with |ref| >= {st.ulp_floor:.3g} (0.01 x RMS of the reference)" in failing.reason
    # ... and ulp_floor=0 judges every element (elementwise kernels, whose small
    # outputs are as exact as their large ones).
    every = compare(out, ref, Tolerance(ulp=16, ulp_floor=0.0))
    assert not every.passed and every.max_ulp == every.max_ulp_all and every.n_violations == 2
    # A non-finite value below the floor still shows.
    out[3] = float("inf")
    assert compare(out, ref, Tolerance(rel_fro=1.0)).max_ulp == math.inf
