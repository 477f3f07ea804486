from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from infra_agent.lab.correctness import KERNEL, check_spec
from infra_agent.lab.loader import load_specs, select


def _one(path: Path, name: str | None = None):
    return select(load_specs(path), name)[0]


def test_matmul_spec_passes_every_variant_and_precision(specs_dir: Path) -> None:
    spec = _one(specs_dir / "matmul_spec.py")
    report = check_spec(spec, n_seeds=2, device="cpu")
    assert report.passed, [r.to_dict() for r in report.failures]
    got = {(r.variant, r.precision) for r in report.results if r.status == "passed"}
    want = {(v, p) for v in (KERNEL, "split_k4", "col_shard2", "row_shard2") for p in spec.precisions}
    assert got == want
    # col_shard2 needs an even N: it ran on N=24 and was left out for N=9.
    shapes = {r.shape for r in report.results if r.variant == "col_shard2"}
    assert shapes == {"M=32,N=24,K=256"}


def test_split_k_rounding_partials_caught_under_tf32_only(specs_dir: Path) -> None:
    spec = _one(specs_dir / "splitk_bug_spec.py")
    report = check_spec(spec, seeds=[11], device="cpu")
    by = {(r.variant, r.precision): r for r in report.results}
    assert by[("split_k4_gemm_reduce", "fp32")].status == "passed"
    bad = by[("split_k4_gemm_reduce", "tf32")]
    assert bad.status == "failed" and bad.against == KERNEL
    assert bad.condition is not None and bad.condition.seed == 11 and bad.condition.precision == "tf32"
    # The reported worst element is the largest deviation from the unpartitioned GEMM.
    module_inputs = spec.inputs({"M": 32, "N": 32, "K": 256}, torch.float32, 11, "cpu")
    ref = spec.kernel(**module_inputs, precision="tf32")
    var = spec.variant("split_k4_gemm_reduce").fn(**module_inputs, precision="tf32")
    diff = (var.double() - ref.double()).abs()
    flat = int(diff.argmax())
    assert bad.stats is not None
    assert bad.stats.worst_index == (flat // 32, flat % 32)
    assert bad.stats.max_abs == float(diff.max())
    # And the unpartitioned kernel itself is within its tf32 tolerance of the truth.
    assert by[(KERNEL, "tf32")].status == "passed"


def test_faulty_kernels_fail_with_condition_and_never_crash(specs_dir: Path) -> None:
    specs = {s.name: s for s in load_specs(specs_dir / "faulty_kernels_spec.py")}
    expect = {
        "raises": "raised RuntimeError: illegal memory access",
        "nan": "non-finite",
        "inf": "non-finite",
        "wrong_shape": "wrong shape (15,), expected (16,)",
        "wrong_dtype": "wrong dtype torch.float64, expected torch.float32",
        "returns_none": "expected a tensor",
    }
    for name, text in expect.items():
        report = check_spec(specs[name], seeds=[3], device="cpu")
        assert not report.passed, name
        (fail,) = report.failures
        assert text in fail.message, (name, fail.message)
        assert fail.condition is not None and fail.condition.seed == 3 and fail.condition.shape == "N=16"
    nan_index = check_spec(specs["nan"], seeds=[3]).failures[0].stats
    assert nan_index is not None and nan_index.worst_index == (3,)
    mixed = check_spec(specs["good_with_nan_variant"], seeds=[5])
    status = {r.variant: r.status for r in mixed.results}
    assert status == {KERNEL: "passed", "nan_shard": "failed", "ok_shard": "passed"}


def test_variants_skipped_when_unpartitioned_kernel_raises(specs_dir: Path) -> None:
    spec = _one(specs_dir / "faulty_kernels_spec.py", "good_with_nan_variant")
    broken = dataclasses.replace(spec, kernel=_one(specs_dir / "faulty_kernels_spec.py", "raises").kernel)
    report = check_spec(broken, seeds=[1])
    assert [r.status for r in report.results if r.variant != KERNEL] == ["skipped", "skipped"]


def test_seeds_are_fresh_per_run_unless_pinned(specs_dir: Path) -> None:
    spec = _one(specs_dir / "faulty_kernels_spec.py", "good_with_nan_variant")
    a = check_spec(spec, n_seeds=3)
    b = check_spec(spec, n_seeds=3)
    assert len(a.seeds) == 3 and a.seeds != b.seeds
    assert {r.seed for r in a.results} == set(a.seeds)
    pinned = dataclasses.replace(spec, seeds=(42,))
    assert check_spec(pinned, n_seeds=3).seeds == [42]


def test_gpu_only_precision_skipped_on_cpu(specs_dir: Path) -> None:
    spec = dataclasses.replace(_one(specs_dir / "matmul_spec.py"), gpu_only_precisions=("3xtf32",))
    report = check_spec(spec, seeds=[0], device="cpu", variants=[])
    assert any("precision 3xtf32 is GPU-only" in s for s in report.skipped)
    assert "3xtf32" not in {r.precision for r in report.results}
    assert report.passed


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_gpu_is_skipped_not_crashed(specs_dir: Path) -> None:
    report = check_spec(_one(specs_dir / "matmul_spec.py"), seeds=[0], device="cuda")
    assert report.results == [] and "no CUDA device" in report.skipped[0]


def test_in_place_kernel_gets_its_own_inputs(specs_dir: Path) -> None:
    # The tiled KDA step writes its state in place; the reference must still see the
    # original state, and every tile-size variant must agree with BV=32.
    report = check_spec(_one(specs_dir / "kda_decode_spec.py"), seeds=[0, 1])
    assert report.passed, [r.to_dict() for r in report.failures]
    assert {r.output for r in report.results} == {"o", "state"}


def test_outputs_hook_checks_rows_updated_in_place_and_is_not_timed(specs_dir: Path) -> None:
    """An in-place kernel is checked through the rows ``outputs`` reads after the call:
    the right kernel passes, one that writes the wrong row fails on ``pool`` only, and
    timing calls the kernel alone (the hook's gather would double the bytes moved)."""
    from infra_agent.lab.microbench import bench_spec

    spec = _one(specs_dir / "inplace_spec.py")
    report = check_spec(spec, seeds=[3], device="cpu")
    by = {(r.variant, r.output): r.status for r in report.results}
    assert by[(KERNEL, "y")] == "passed" and by[(KERNEL, "pool")] == "passed"
    assert by[("wrong_row", "y")] == "passed" and by[("wrong_row", "pool")] == "failed"

    picks = spec.outputs.__globals__["PICKS"]
    before = picks["n"]
    bench = bench_spec(spec, device="cpu", variants=[], n_seeds=1, budget_s=0.02, copy_bytes=1 << 20, matmul_n=64)
    timed = [e for e in bench.entries if e.timing is not None]
    assert timed and all(e.timing.samples_s for e in timed)
    # The bench's correctness gate calls the hook once per checked call; the timing none.
    assert picks["n"] - before == len(bench.checks[0].results) // 2
