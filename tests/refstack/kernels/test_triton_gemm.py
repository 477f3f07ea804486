"""The Triton GEMM: under the interpreter on the CPU (small shapes), on CUDA when present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Runs in a fresh interpreter: TRITON_INTERPRET must be set before the kernels are
# defined, and must not leak into other tests that compile real kernels.
_INTERPRETED = textwrap.dedent(
    """
    import json, torch
    from refstack.kernels.triton_gemm import gemm, split_lo
    from refstack.kernels.precision import matmul_emulated
    torch.manual_seed(0)
    out = {}
    for M, K, N in [(37, 70, 45), (64, 64, 64)]:
        a, b = torch.randn(M, K), torch.randn(K, N)
        ref = a.double() @ b.double()
        err = lambda c, r=ref: ((c.double() - r).norm() / r.norm()).item()
        key = f"{M}x{K}x{N}"
        for p in ["ieee", "tf32", "tf32x3", "bf16"]:
            out[f"{key}/{p}"] = err(gemm(a, b, p))
        out[f"{key}/tf32x3-native"] = err(gemm(a, b, "tf32x3", tf32x3_impl="native"))
        bt = torch.randn(N, K).t()          # a transposed weight view, as in x @ W.T
        out[f"{key}/tf32x3-transposed-b"] = err(gemm(a, bt, "tf32x3"), a.double() @ bt.double())
        out[f"{key}/bf16-vs-emulated"] = (gemm(a, b, "bf16") - matmul_emulated(a, b, "bf16")).abs().max().item()
        x = torch.randn(M, K)
        lo = split_lo(x)
        out[f"{key}/split_lo"] = (lo - (x - (x.view(torch.int32) & -8192).view(torch.float32))).abs().max().item()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, float]:
    if torch.cuda.is_available():
        # Real kernels are tested below; and Triton 3.6's interpreter (seen on a GPU
        # machine) cannot run a loop bound by a kernel argument under numpy 2.5.
        pytest.skip("interpreter path is checked on CPU-only machines")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreted_gemm_matches_torch(interpreted: dict[str, float]) -> None:
    # The interpreter's dot is an exact fp32 matmul, so every mode lands at fp32 level
    # (bf16 at bf16 level); this checks indexing, masking, strides and the split.
    for key, err in interpreted.items():
        if key.endswith("/bf16"):
            assert err < 1e-2, key
        elif key.endswith("/bf16-vs-emulated"):
            assert err < 1e-4, key
        elif key.endswith("/split_lo"):
            assert err == 0.0, key
        else:
            assert err < 1e-6, (key, err)


def test_gemm_rejects_bad_arguments() -> None:
    from refstack.kernels.triton_gemm import gemm

    with pytest.raises(ValueError, match="precision"):
        gemm(torch.zeros(2, 3), torch.zeros(3, 4), "fp16")
    with pytest.raises(ValueError, match="gemm needs"):
        gemm(torch.zeros(2, 3), torch.zeros(4, 4), "tf32")


def _rel(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 1024, 384), (257, 1000, 129)])
def test_gpu_gemm_error_levels(shape: tuple[int, int, int]) -> None:
    from refstack.kernels.triton_gemm import gemm

    M, K, N = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(K, N, device="cuda", generator=g)
    ref = a.double() @ b.double()
    assert _rel(gemm(a, b, "ieee"), ref) < 1e-6
    assert 1e-5 < _rel(gemm(a, b, "tf32"), ref) < 2e-3
    assert _rel(gemm(a, b, "tf32x3"), ref) < 1e-6
    assert _rel(gemm(a, b, "tf32x3", tf32x3_impl="native"), ref) < 1e-6
    assert _rel(gemm(a, b, "bf16"), ref) < 1e-2
    bt = torch.randn(N, K, device="cuda", generator=g).t()
    assert _rel(gemm(a, bt, "tf32x3"), a.double() @ bt.double()) < 1e-6


@pytest.mark.gpu
def test_gpu_tf32_mma_truncates_like_the_emulation() -> None:
    # The presplit kernel feeds raw fp32 to TF32 MMAs, relying on the hardware to use
    # only the top 10 mantissa bits (truncation).  If it rounded instead, Triton tf32
    # would differ from the truncation emulation at the 1e-4 level, not ~1e-7.
    from refstack.kernels.precision import matmul_emulated
    from refstack.kernels.triton_gemm import gemm

    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(256, 2048, device="cuda", generator=g)
    b = torch.randn(2048, 256, device="cuda", generator=g)
    emulated = matmul_emulated(a, b, "tf32").double()
    assert _rel(gemm(a, b, "tf32"), emulated) < 1e-5


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs a Hopper GPU (wgmma); its results live in docs/performance.md")
@pytest.mark.parametrize("shape", [(512, 1024, 384), (257, 1000, 129), (1, 4096, 200)])
def test_gpu_gluon_gemm3_meets_the_bar_and_agrees_with_presplit(shape: tuple[int, int, int]) -> None:
    # Ragged M, N and a K tail (1000 = 31 blocks of 32 + 8) exercise the copy engine's
    # zero fill at every edge; a NaN-poisoned output catches an unwritten tile.
    from refstack.kernels.triton_gemm import gemm, split_operand

    M, K, N = shape
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(M, K, device="cuda", generator=g)
    w = torch.randn(N, K, device="cuda", generator=g)  # a weight, used as x @ W.T
    ref = a.double() @ w.double().t()
    junk = torch.full((M, N), float("nan"), device="cuda")
    del junk
    glu = gemm(a, w.t(), "tf32x3", tf32x3_impl="gluon")
    assert torch.isfinite(glu).all()
    assert _rel(glu, ref) < 1e-6
    assert _rel(glu, gemm(a, w.t(), "tf32x3", tf32x3_impl="presplit").double()) < 1e-6
    cached = gemm(a, w.t(), "tf32x3", tf32x3_impl="gluon", b_split=split_operand(w.t(), 0))
    assert torch.equal(cached, glu)  # same kernel, same operands: bitwise
    assert torch.equal(gemm(a, w.t(), "tf32x3"), glu)  # "auto" picks it on Hopper


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs a Hopper GPU (wgmma)")
def test_gpu_gluon_gemm3_refuses_rows_the_copy_engine_cannot_read() -> None:
    from refstack.kernels.triton_gemm import gemm

    a = torch.randn(64, 1001, device="cuda")  # K % 4 != 0: rows not 16-byte aligned
    b = torch.randn(1001, 64, device="cuda")
    with pytest.raises(ValueError, match="K % 4 == 0"):
        gemm(a, b, "tf32x3", tf32x3_impl="gluon")
    assert _rel(gemm(a, b, "tf32x3"), a.double() @ b.double()) < 1e-6  # "auto" falls back to presplit


def test_gluon_impl_is_refused_where_it_cannot_run() -> None:
    # CPU tensors (and any non-Hopper device) get a clear error for an explicit
    # "gluon"; the default "auto" quietly uses the Triton kernel there instead.
    from refstack.kernels.triton_gemm import gemm

    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        gemm(torch.randn(8, 8), torch.randn(8, 8), "tf32x3", tf32x3_impl="gluon")
    with pytest.raises(ValueError, match="tf32x3_impl must be"):
        gemm(torch.randn(8, 8), torch.randn(8, 8), "tf32x3", tf32x3_impl="cutlass")
