"""The lab's CUDA paths: events with a flushed L2, do_bench, cuBLAS ceilings, and the
Triton KDA twin on the hardware.  Skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import pytest
import torch

from infra_agent.kernels.correctness import check_spec
from infra_agent.kernels.loader import load_specs
from infra_agent.kernels.microbench import bench_spec
from infra_agent.kernels.roofline import measure_ceilings
from infra_agent.kernels.spec import Variant
from infra_agent.kernels.timing import time_cuda
from infra_agent.kernels.work import WorkCounter

pytestmark = pytest.mark.gpu


def test_cuda_timing_events_and_do_bench() -> None:
    x = torch.randn(64 * 2**20 // 4, device="cuda")
    y = torch.empty_like(x)
    ev = time_cuda(lambda: y.copy_(x), reps=20)
    db = time_cuda(lambda: y.copy_(x), method="do_bench")
    for t in (ev, db):
        assert 0 < t.ci_low_s <= t.median_s <= t.ci_high_s < 1e-2
    # 128 MB moved: a cold-L2 copy on any current GPU takes >10 us and <10 ms.
    assert 1e-5 < ev.median_s < 1e-2 and "L2 flushed" in ev.notes[0]


def test_cuda_ceilings_ordering() -> None:
    c = measure_ceilings("cuda", ("fp32", "tf32", "bf16"), copy_bytes=2**30, matmul_n=4096)
    assert c.bandwidth_Bps > 5e11  # a datacenter GPU copies at > 0.5 TB/s
    assert c.flops_per_s["tf32"] > 2 * c.flops_per_s["fp32"]  # tensor cores engaged
    assert c.flops_per_s["bf16"] > c.flops_per_s["tf32"]
    assert torch.get_float32_matmul_precision() == "highest"  # restored


def test_check_and_bench_matmul_on_cuda(specs_dir: Path) -> None:
    (spec,) = load_specs(specs_dir / "matmul_spec.py")
    assert check_spec(spec, n_seeds=2, device="cuda").passed
    report = bench_spec(spec, device="cuda", precisions=["fp32"], copy_bytes=2**30, matmul_n=4096)
    timed = [e for e in report.entries if e.status == "timed"]
    assert timed and all(e.timing and e.timing.method == "cuda_events" for e in timed)


def test_triton_kda_on_gpu_matches_and_counts(specs_dir: Path) -> None:
    from infra_agent.kernels.tiled_kda_triton import kda_decode_triton

    (spec,) = load_specs(specs_dir / "kda_decode_spec.py")
    triton_variants = [
        Variant(f"triton BV={bv}", partial(kda_decode_triton, BV=bv), work=partial(kda_decode_triton, BV=bv), gpu_only=True)
        for bv in (16, 32, 64, 128)
    ]
    spec = dataclasses.replace(spec, variants=triton_variants, shapes=[{"N": 4, "H": 4, "K": 64, "V": 128}])
    report = check_spec(spec, n_seeds=2, device="cuda")
    assert report.passed, [r.to_dict() for r in report.failures]
    shape = spec.shapes[0]
    inputs = spec.inputs(shape, torch.float32, 0, "cuda")
    counter = WorkCounter()
    kda_decode_triton(**inputs, BV=32, counter=counter)
    ops = {w.op: w for w in counter.ops()}
    assert ops["l2norm_qk"].repeat_factor == 4 and ops["l2norm_qk"].unique_keys == 16


def test_isolated_check_on_cuda_survives_a_hung_variant(specs_dir: Path) -> None:
    # The worker is started fresh (not forked), so it can use CUDA; a worker killed
    # while it holds a CUDA context does not keep the next one from using the GPU.
    from infra_agent.kernels.loader import select
    from infra_agent.kernels.probe import run_lab

    fb, (report,) = run_lab(load_specs(specs_dir / "matmul_spec.py"), "check", {"device": "cuda", "seeds": 1})
    assert fb.ok and report.timeout_s == 60 and report.device == "cuda"  # type: ignore[union-attr]
    hang = select(load_specs(specs_dir / "hang_spec.py"), "hang")
    fb, (report,) = run_lab(hang, "check", {"device": "cuda", "timeout_s": 5})
    status = {r.variant: (r.status, r.fault) for r in report.results}  # type: ignore[union-attr]
    assert status["sleeps"] == ("failed", "timeout") and status["exits"] == ("failed", "crashed")
    assert status["ok_before"] == status["ok_after"] == status["kernel"] == ("passed", None)
