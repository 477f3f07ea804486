from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from infra_agent.errors import ConfigError, KernelSpecError
from infra_agent.feedback import Feedback, Tier
from infra_agent.lab.correctness import CheckReport, CheckResult
from infra_agent.lab.loader import load_specs
from infra_agent.lab.numerics import ErrorStats
from infra_agent.probes import ProbeContext, get_probe
from infra_agent.probes.kernel import (
    KernelConfig,
    KernelProbe,
    check_feedback_parts,
    run_lab,
)

FAST_BENCH = {"mode": "bench", "budget_s": 0.02, "copy_bytes": 4 * 2**20, "matmul_n": 128, "seeds": 1}


def test_check_feedback_names_worst_element_and_round_trips(specs_dir: Path, tmp_path: Path) -> None:
    probe = get_probe("kernel")()
    # Pinned to the CPU, like the other tests of the Feedback's shape (the GPU's counts:
    # test_gpu.py::test_splitk_bug_counts_on_cuda_whatever_tf32_allows).
    fb = probe.run({"spec": str(specs_dir / "splitk_bug_spec.py"), "seeds": 2, "device": "cpu"}, ProbeContext(workdir=tmp_path))
    assert fb.tier == Tier.check and not fb.ok
    (mismatch,) = [f for f in fb.findings if f.kind == "mismatch"]
    assert mismatch.evidence["precision"] == "tf32" and mismatch.evidence["against"] == "kernel"
    assert mismatch.location is not None and mismatch.location.component is None
    assert (mismatch.location.variant, mismatch.location.precision) == ("split_k4_gemm_reduce", "tf32")
    # ULP over elements near the output's scale; the figure over every element is kept.
    assert 0 < mismatch.evidence["max_ulp"] <= mismatch.evidence["max_ulp_all"] and mismatch.evidence["ulp_floor"] > 0
    assert len(mismatch.evidence["worst_index"]) == 2
    assert "seed=" in mismatch.evidence["condition"] and "variant=split_k4_gemm_reduce" in mismatch.evidence["condition"]
    assert mismatch.next_question and "fp32" in mismatch.next_question  # it passes there
    # Only the norm criterion failed: no element is marked, and the evidence says why.
    assert mismatch.evidence["violated"] == ["rel_fro"] and mismatch.evidence["n_violations"] == 0
    m = fb.measurement("rel_fro_error_vs_kernel", variant="split_k4_gemm_reduce", knob="precision=tf32")
    assert m.value > 1e-6 and m.tags["input"].startswith("M=32,N=32,K=256")
    assert Feedback.from_json(fb.to_json()) == fb
    assert Path(fb.artifacts[0].path).is_file()


def test_bench_feedback_has_roofline_and_repeated_work(specs_dir: Path, tmp_path: Path) -> None:
    fb = get_probe("kernel")().run({"spec": str(specs_dir / "kda_decode_spec.py"), **FAST_BENCH}, ProbeContext(workdir=tmp_path))
    assert fb.tier == Tier.micro and fb.ok
    t = fb.measurement("time", variant="BV=16")
    assert t.unit == "s" and t.value > 0 and t.better == "lower"
    assert fb.measurement("ceiling_copy_bandwidth").value > 0
    roofline = [f for f in fb.findings if f.kind == "roofline"]
    assert {f.location.variant for f in roofline if f.location} == {"kernel", "BV=16", "BV=64", "BV=128"}
    assert all(f.location and f.location.precision == "fp32" and f.location.component is None for f in roofline)
    # A memory-bound entry is set beside a copy of its bytes; a compute-bound one is not.  FAST_BENCH's
    # small ceilings put this spec's entries near the ridge, on either side depending on the machine,
    # so both branches are checked; the memory-bound case is pinned in
    # test_cli.py::test_bench_times_a_copy_of_each_inputs_bytes_beside_its_entries.
    for f in roofline:
        memory = f.evidence["bound"] == "memory"
        assert memory == ("a plain copy of the same bytes takes" in f.message) == ("own_share" in f.evidence), f.message
        if memory:
            assert fb.measurement("fraction_of_copy_same_bytes", variant=f.location.variant).value > 0
    repeated = {(f.location.variant, f.evidence["op"]): f.evidence["repeat_factor"] for f in fb.findings if f.kind == "repeated_work" and f.location}
    # V=128: BV=16 -> 8x, shipped BV=32 -> 4x, BV=64 -> 2x, BV=128 -> no repeat (no finding).
    assert repeated[("BV=16", "l2norm_qk")] == 8 and repeated[("kernel", "gate")] == 4
    assert repeated[("BV=64", "l2norm_qk")] == 2 and ("BV=128", "l2norm_qk") not in repeated
    assert Feedback.from_json(fb.to_json()) == fb


def test_bench_refuses_speed_for_failing_combination(specs_dir: Path, tmp_path: Path) -> None:
    config = {"spec": str(specs_dir / "splitk_bug_spec.py"), **FAST_BENCH, "device": "cpu"}
    fb = get_probe("kernel")().run(config, ProbeContext(workdir=tmp_path))
    assert not fb.ok
    # One failing check row and the one entry it refuses: counted apart, not "2".
    assert fb.error == "1 failed check, 1 refused bench entry"
    refused = [f for f in fb.findings if f.kind == "bench_refused"]
    assert len(refused) == 1 and "split_k4_gemm_reduce tf32" in refused[0].message
    timed = {(m.tags["variant"], m.tags["knob"]) for m in fb.measurements if m.name == "time"}
    assert timed == {("kernel", "precision=fp32"), ("kernel", "precision=tf32"), ("split_k4_gemm_reduce", "precision=fp32")}


def test_base_tier_is_cheapest_and_tier_of_config_matches_feedback(specs_dir: Path, tmp_path: Path) -> None:
    assert KernelProbe.base_tier == Tier.check and KernelProbe.tier() == Tier.check
    check = KernelProbe.parse_config({"spec": "s.py"})
    bench = KernelProbe.parse_config({"spec": "s.py", "mode": "bench"})
    assert isinstance(check, KernelConfig) and KernelProbe.tier(check) == Tier.check and KernelProbe.tier(bench) == Tier.micro
    assert all(KernelProbe.base_tier.rank <= KernelProbe.tier(c).rank for c in (check, bench))
    for bad in ({"spec": "s.py", "mode": "profile"}, {"spec": "s.py", "timeout_s": -1}, {"spec": "s.py", "seed": 3}):
        with pytest.raises(ConfigError):
            KernelProbe.parse_config(bad)
    config = {"spec": str(specs_dir / "bench_raises_spec.py"), **FAST_BENCH}
    fb = KernelProbe().run(config, ProbeContext(workdir=tmp_path))
    assert fb.tier == KernelProbe.tier(KernelProbe.parse_config(config)) == Tier.micro
    # run() takes the typed config as well as a mapping.
    typed = KernelConfig(spec=str(specs_dir / "matmul_spec.py"), seeds=1, precisions="fp32", variants=["kernel"], device="cpu")
    fb = KernelProbe().run(typed, ProbeContext(workdir=tmp_path, progress=False))
    assert fb.ok and fb.tier == Tier.check and fb.meta["checked"] > 0


def test_bench_entry_raising_while_timed_fails_the_run(specs_dir: Path, tmp_path: Path) -> None:
    fb = get_probe("kernel")().run({"spec": str(specs_dir / "bench_raises_spec.py"), **FAST_BENCH}, ProbeContext(workdir=tmp_path))
    assert not fb.ok and fb.error == "1 bench entry raised while timed"
    assert [f.kind for f in fb.findings if f.severity == "error"] == ["bench_failed"]
    assert fb.meta["checked"] > 0 and fb.meta["timing_failures"] == 1


def test_error_metric_interval_stays_within_the_samples() -> None:
    def result(seed: int, err: float) -> CheckResult:
        stats = ErrorStats(err, err, err * 1e6, err, (0,), 0.0, 0.0, 4)
        return CheckResult("kernel", "reference", "fp32", "N=4", "float32", seed, "out", "passed", stats=stats)

    # Two seeds two orders of magnitude apart.  The interval is a bootstrap interval of
    # the median: it lies within the observed errors, so it is never negative and
    # needs no clamping (a t-interval of the mean would reach -6e-5 here).
    report = CheckReport("s", "", "cpu", [1, 2], results=[result(1, 1e-7), result(2, 1e-5)])
    ms, _ = check_feedback_parts(report)
    assert {m.name for m in ms} == {"rel_fro_error_vs_reference", "max_abs_error_vs_reference", "max_ulp_vs_reference"}
    for m in ms:
        s = m.summary
        assert s is not None and s.ci_stat == "median" and m.better == "lower"
        assert 0 < s.min <= s.ci_low <= s.median <= s.ci_high <= s.max


def test_names_several_specs_declare_apply_where_declared(specs_dir: Path) -> None:
    (matmul,) = load_specs(specs_dir / "matmul_spec.py")
    fp32_only = dataclasses.replace(matmul, name="fp32_only", precisions=("fp32",), variants=())
    fb, reports = run_lab([matmul, fp32_only], "check", {"seeds": 1, "device": "cpu", "precisions": "tf32", "variants": "split_k4"})
    assert fb.ok and fb.meta["checked"] > 0
    assert {r.precision for r in reports[0].results} == {"tf32"}  # type: ignore[union-attr]
    assert reports[1].results == [] and any("declares none of the requested precisions" in s for s in fb.meta["skipped"])
    with pytest.raises(KernelSpecError, match=r"specs 'matmul', 'fp32_only': unknown precision 'fp46'"):
        run_lab([matmul, fp32_only], "check", {"seeds": 1, "device": "cpu", "precisions": "fp46"})
