"""The lab's CUDA paths: events with a flushed L2 and the launch hidden, CUDA-graph
replay, do_bench, host time and the launch-bound finding, cuBLAS ceilings, and the
Triton KDA twin on the hardware.  Skipped without a GPU (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from infra_agent.lab.correctness import check_spec
from infra_agent.lab.findings import (
    LAUNCH_BOUND,
    bench_feedback_parts,
    launch_bound,
)
from infra_agent.lab.loader import load_specs
from infra_agent.lab.microbench import bench_spec
from infra_agent.lab.roofline import measure_ceilings
from infra_agent.lab.spec import KernelSpec, Variant
from infra_agent.lab.timing import time_cuda
from infra_agent.lab.work import WorkCounter
from infra_agent.probes.kernel import run_lab

pytestmark = pytest.mark.gpu


def test_cuda_timing_events_and_do_bench() -> None:
    x = torch.randn(64 * 2**20 // 4, device="cuda")
    y = torch.empty_like(x)
    ev = time_cuda(lambda: y.copy_(x), reps=20)
    old = time_cuda(lambda: y.copy_(x), reps=20, method="cuda_events")
    db = time_cuda(lambda: y.copy_(x), method="do_bench")
    for t in (ev, old, db):
        assert 0 < t.ci_low_s <= t.median_s <= t.ci_high_s < 1e-2
        assert t.host_median_s is not None and t.host_ci_low_s is not None and t.host_median_s > 0
    # 128 MB moved: a cold-L2 copy on any current GPU takes >10 us and <10 ms.
    assert 1e-5 < ev.median_s < 1e-2 and "L2 flushed" in ev.notes[0]
    assert ev.method == "cuda_events_delayed" and any("launch hidden" in n for n in ev.notes)
    assert old.method == "cuda_events" and not any("launch hidden" in n for n in old.notes)


def _slow_add(x: torch.Tensor, *, precision: str = "fp32") -> torch.Tensor:
    time.sleep(200e-6)  # Python work before the launch, as in a wrapper with many arguments
    return x.add_(1)


def test_delayed_events_time_the_gpu_not_a_slow_python_wrapper() -> None:
    x = torch.zeros(16, device="cuda")
    t = time_cuda(lambda: _slow_add(x), reps=30)
    assert t.host_median_s is not None and t.host_median_s >= 200e-6
    # Adding 1 to 16 floats takes the GPU a few µs; generous factors, no tight bounds.
    assert t.median_s < t.host_median_s / 4 and launch_bound(t)
    old = time_cuda(lambda: _slow_add(x), reps=30, method="cuda_events")
    assert old.median_s > 3 * t.median_s  # the old events counted the wrapper's sleep
    # The spin is sized from the host's 90th-percentile call, so on a busy host (a parallel
    # test run) an odd rep can outlast it; the timer says so in a note.  Most reps must not.
    overran = [n for n in t.notes if "longer than the spin" in n]
    assert all(int(n.split("/")[0]) <= 3 for n in overran), t.notes


def _one_input(shape, dtype, seed, device):  # type: ignore[no-untyped-def]
    return {"x": torch.randn(shape["N"], generator=torch.Generator().manual_seed(seed)).to(device, dtype)}


def test_bench_flags_a_launch_bound_kernel_and_not_a_large_copy() -> None:
    common = {"reference": lambda x: x.double() + 1, "inputs": _one_input, "bytes_moved": lambda s, dt: 8.0 * s["N"]}
    slow = KernelSpec(name="slow_wrapper", kernel=lambda x, *, precision="fp32": _slow_add(x.clone()), shapes=[{"N": 16}], **common)
    copy = KernelSpec(name="copy", kernel=lambda x, *, precision="fp32": x + 1, shapes=[{"N": 64 * 2**20}], **common)
    for spec, expect in ((slow, True), (copy, False)):
        report = bench_spec(spec, device="cuda", n_seeds=1, copy_bytes=2**28, matmul_n=1024)
        (entry,) = report.entries
        assert entry.status == "timed" and entry.timing is not None, entry.message
        assert entry.timing.to_dict()["host_s"]["median_s"] > 0
        _, fs = bench_feedback_parts(report)
        found = [f for f in fs if f.kind == LAUNCH_BOUND]
        assert bool(found) == expect, (spec.name, entry.timing.to_dict())
        if not expect:  # 512 MiB through HBM takes ~100x longer than its launch
            assert entry.timing.host_median_s is not None and entry.timing.host_median_s < entry.timing.median_s


def test_cuda_graph_replays_and_falls_back_when_not_capturable() -> None:
    x = torch.randn(2**22, device="cuda")
    y = torch.empty_like(x)
    g = time_cuda(lambda: y.copy_(x), method="cuda_graph", reps=20)
    ev = time_cuda(lambda: y.copy_(x), reps=20)
    assert g.method == "cuda_graph" and any("CUDA graph" in n for n in g.notes)
    assert 0.2 < g.median_s / ev.median_s < 5  # the same copy, timed two ways
    y.zero_()
    torch.cuda.synchronize()
    # A host read of a device value cannot be captured: timed as plain delayed events, noted.
    f = time_cuda(lambda: float(y.copy_(x)[0]), method="cuda_graph", reps=10)
    assert f.method == "cuda_events_delayed" and any("not capturable" in n for n in f.notes), f.notes
    assert torch.equal(y, x)
    assert torch.randn(4, device="cuda").isfinite().all()  # no capture was left half-done (RNG intact)


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
    assert timed and all(e.timing and e.timing.method == "cuda_events_delayed" for e in timed)
    assert all(e.timing and e.timing.host_median_s for e in timed)


def test_triton_kda_on_gpu_matches_and_counts(specs_dir: Path) -> None:
    from infra_agent.lab.tiled_kda_triton import kda_decode_triton

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
    from infra_agent.lab.loader import select
    from infra_agent.probes.kernel import run_lab

    fb, (report,) = run_lab(load_specs(specs_dir / "matmul_spec.py"), "check", {"device": "cuda", "seeds": 1})
    assert fb.ok and report.timeout_s == 60 and report.device == "cuda"  # type: ignore[union-attr]
    hang = select(load_specs(specs_dir / "hang_spec.py"), "hang")
    fb, (report,) = run_lab(hang, "check", {"device": "cuda", "timeout_s": 5})
    status = {r.variant: (r.status, r.fault) for r in report.results}  # type: ignore[union-attr]
    assert status["sleeps"] == ("failed", "timeout") and status["exits"] == ("failed", "crashed")
    assert status["ok_before"] == status["ok_after"] == status["kernel"] == ("passed", None)


@pytest.mark.parametrize("allowed", ["highest", "high"])
def test_splitk_bug_counts_on_cuda_whatever_tf32_allows(specs_dir: Path, allowed: str) -> None:
    # "high" lets cuBLAS run fp32 GEMMs as TF32.  The spec pins IEEE fp32 for its GEMMs
    # (tf32 is emulated on truncated operands), so the counts are the CPU's: the split-K
    # variant fails under tf32 only, and bench refuses that one entry.  timeout_s 0: the
    # calls run in this process, where the setting applies (a check worker starts fresh).
    specs = load_specs(specs_dir / "splitk_bug_spec.py")
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(allowed)
    try:
        fb, (report,) = run_lab(specs, "check", {"device": "cuda", "seeds": 2, "timeout_s": 0})
        bench, _ = run_lab(specs, "bench", {"device": "cuda", "seeds": 1, "timeout_s": 0, "budget_s": 0.02,
                                            "copy_bytes": 2**26, "matmul_n": 1024})
    finally:
        torch.set_float32_matmul_precision(prev)
    assert {(r.variant, r.precision) for r in report.failures} == {("split_k4_gemm_reduce", "tf32")}  # type: ignore[union-attr]
    assert fb.meta["failed_checks"] == 1 and bench.error == "1 failed check, 1 refused bench entry"


def test_plain_fp32_gemm_under_hardware_tf32_is_caught_on_cuda(specs_dir: Path) -> None:
    # Where the device matters: on a GPU, an unpinned fp32 ``a @ b`` is a TF32 product
    # once the process allows TF32 (on the CPU it stays fp32).  The lab must fail that
    # fp32 row at TF32 error levels rather than pass it.
    (spec,) = load_specs(specs_dir / "matmul_spec.py")
    plain = dataclasses.replace(spec, kernel=lambda a, b, *, precision="fp32": a @ b, variants=(), precisions=("fp32",),
                                shapes=[{"M": 256, "N": 256, "K": 256}], bench_shapes=None)
    reports = {}
    prev = torch.get_float32_matmul_precision()
    for allowed in ("highest", "high"):
        torch.set_float32_matmul_precision(allowed)
        try:
            reports[allowed] = check_spec(plain, seeds=[0], device="cuda")
        finally:
            torch.set_float32_matmul_precision(prev)
    assert reports["highest"].passed
    (fail,) = reports["high"].failures
    assert fail.precision == "fp32" and fail.stats is not None and fail.stats.rel_fro > 1e-5  # tolerance 1e-6
