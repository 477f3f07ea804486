from __future__ import annotations

from pathlib import Path

from infra_agent.feedback import Feedback, Tier
from infra_agent.probes import ProbeContext, get_probe

FAST_BENCH = {"mode": "bench", "budget_s": 0.02, "copy_bytes": 4 * 2**20, "matmul_n": 128, "seeds": 1}


def test_check_feedback_names_worst_element_and_round_trips(specs_dir: Path, tmp_path: Path) -> None:
    probe = get_probe("kernel")()
    fb = probe.run({"spec": str(specs_dir / "splitk_bug_spec.py"), "seeds": 2}, ProbeContext(workdir=tmp_path))
    assert fb.tier == Tier.check and not fb.ok
    (mismatch,) = [f for f in fb.findings if f.kind == "mismatch"]
    assert mismatch.evidence["precision"] == "tf32" and mismatch.evidence["against"] == "kernel"
    assert len(mismatch.evidence["worst_index"]) == 2
    assert "seed=" in mismatch.evidence["condition"] and "variant=split_k4_gemm_reduce" in mismatch.evidence["condition"]
    assert mismatch.next_question and "fp32" in mismatch.next_question  # it passes there
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
    assert {f.location.component for f in roofline if f.location} == {"variant=kernel", "variant=BV=16", "variant=BV=64", "variant=BV=128"}
    repeated = {(f.location.component, f.evidence["op"]): f.evidence["repeat_factor"] for f in fb.findings if f.kind == "repeated_work" and f.location}
    # V=128: BV=16 -> 8x, shipped BV=32 -> 4x, BV=64 -> 2x, BV=128 -> no repeat (no finding).
    assert repeated[("variant=BV=16", "l2norm_qk")] == 8 and repeated[("variant=kernel", "gate")] == 4
    assert repeated[("variant=BV=64", "l2norm_qk")] == 2 and ("variant=BV=128", "l2norm_qk") not in repeated
    assert Feedback.from_json(fb.to_json()) == fb


def test_bench_refuses_speed_for_failing_combination(specs_dir: Path, tmp_path: Path) -> None:
    fb = get_probe("kernel")().run({"spec": str(specs_dir / "splitk_bug_spec.py"), **FAST_BENCH}, ProbeContext(workdir=tmp_path))
    assert not fb.ok
    refused = [f for f in fb.findings if f.kind == "bench_refused"]
    assert len(refused) == 1 and "split_k4_gemm_reduce tf32" in refused[0].message
    timed = {(m.tags["variant"], m.tags["knob"]) for m in fb.measurements if m.name == "time"}
    assert timed == {("kernel", "precision=fp32"), ("kernel", "precision=tf32"), ("split_k4_gemm_reduce", "precision=fp32")}
