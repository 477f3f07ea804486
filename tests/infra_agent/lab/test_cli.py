from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra_agent.cli.main import app

runner = CliRunner()
FAST = ["--budget-s", "0.02", "--copy-mib", "4", "--matmul-n", "128", "--seeds", "1"]


def test_check_json_passes(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "matmul_spec.py"), "--seeds", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["ok"] and out["mode"] == "check" and len(out["reports"][0]["seeds"]) == 1
    assert out["feedback"]["tier"] == "check"


def test_check_failure_exit_1_with_condition(specs_dir: Path) -> None:
    # Pinned to the CPU: this is about the exit code and the JSON's shape; the same
    # counts on a GPU are test_gpu.py::test_splitk_bug_counts_on_cuda_whatever_tf32_allows.
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "splitk_bug_spec.py"), "--device", "cpu", "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    failed = [r for r in out["reports"][0]["results"] if r["status"] == "failed"]
    assert failed and all(r["precision"] == "tf32" and r["stats"]["worst_index"] for r in failed)


def test_check_text_table(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "faulty_kernels_spec.py"), "--spec-name", "wrong_shape"], env={"COLUMNS": "200"})
    assert res.exit_code == 1
    assert "FAIL" in res.stdout and "wrong shape" in res.stdout


def test_check_text_says_what_ulp_covers(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "matmul_spec.py"), "--seeds", "1", "--device", "cpu", "--precision", "tf32", "--timeout-s", "0"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "ULP: max over elements with |ref| >= ulp_floor x RMS of the reference (default 0.01)" in text
    assert "max_ulp_all" in text


def test_bench_json(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "bench", str(specs_dir / "matmul_spec.py"), "--device", "cpu", "--precision", "fp32", "--variant", "split_k4", *FAST, "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)["reports"][0]
    assert rep["ceilings"]["bandwidth_GBps"] > 0 and rep["ceilings"]["gflops_per_s"]["fp32"] > 0
    names = {(e["variant"], e["status"]) for e in rep["entries"]}
    assert names == {("kernel", "timed"), ("split_k4", "timed")}
    e = rep["entries"][0]
    assert e["timing"]["median_s"] > 0 and e["roofline"]["bound"] in ("memory", "compute")


def test_bench_text(specs_dir: Path) -> None:
    # DRAM-sized ceilings (see the next test): the copy line prints only for a memory-bound
    # entry, and FAST's in-cache ceilings put this spec's entries on either side of the ridge.
    fast = [*FAST, "--copy-mib", "64", "--matmul-n", "256"]
    res = runner.invoke(app, ["kernel", "bench", str(specs_dir / "kda_decode_spec.py"), "--device", "cpu", *fast],
                        env={"COLUMNS": "240"})
    assert res.exit_code == 0, res.output
    assert "ceilings measured in this run" in res.stdout and "work accounting" in res.stdout and "l2norm_qk" in res.stdout
    assert "vs copy" in res.stdout and "a plain copy of the bytes of [N=2,H=2,K=32,V=128;dtype=float32] takes" in res.stdout


def test_bench_times_a_copy_of_each_inputs_bytes_beside_its_entries(specs_dir: Path) -> None:
    # kda_decode_spec's intensity is ~0.86 FLOP/byte.  With a ceiling copy larger than any cache
    # (64 MiB) and a 256^3 matmul, the ridge sits several times further right, so every entry is
    # memory-bound and is set beside a copy of its input's bytes, timed the same way in the same
    # run.  (FAST's 4 MiB copy stays in cache: its ridge lands near 0.86 and could go either way.)
    fast = [*FAST, "--copy-mib", "64", "--matmul-n", "256"]  # the later flags win
    res = runner.invoke(app, ["kernel", "bench", str(specs_dir / "kda_decode_spec.py"), "--device", "cpu", *fast, "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)["reports"][0]
    (key, copy), = rep["copies_same_bytes"].items()
    assert key == "N=2,H=2,K=32,V=128;dtype=float32" and copy["median_s"] > 0
    for e in rep["entries"]:
        rl = e["roofline"]
        assert rl["bound"] == "memory" and rl["copy_same_bytes_s"] == copy["median_s"]
        assert rl["vs_copy_same_bytes"] == pytest.approx(copy["median_s"] / e["timing"]["median_s"])
        assert rl["copy_same_bytes_fraction"] == pytest.approx(e["bytes"] / copy["median_s"] / (rep["ceilings"]["bandwidth_GBps"] * 1e9))


def test_broken_spec_exit_2(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "broken" / "bad_factory_spec.py"), "--json"])
    assert res.exit_code == 2
    err = json.loads(res.stdout)
    assert err["error"] == "KernelSpecError" and "spec 'bad_factory', input factory: raised KeyError" in err["message"]
    assert "variant" not in err["message"]  # the factory is not a variant


def test_bench_entry_raising_while_timed_exits_1(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "bench", str(specs_dir / "bench_raises_spec.py"), "--device", "cpu", *FAST, "--json"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert not out["ok"] and out["reports"][0]["passed_check"] and not out["reports"][0]["ok"]
    assert out["feedback"]["error"] == "1 bench entry raised while timed"
    (entry,) = out["reports"][0]["entries"]
    assert entry["status"] == "failed" and "state overflow" in entry["message"]


def test_undeclared_precision_or_variant_is_a_user_error(specs_dir: Path) -> None:
    matmul = str(specs_dir / "matmul_spec.py")
    for flag, bad in (("--precision", "fp64"), ("--variant", "split_k5")):
        for mode in ("check", "bench"):
            res = runner.invoke(app, ["kernel", mode, matmul, "--device", "cpu", flag, bad, "--json"])
            assert res.exit_code == 2, (mode, flag, res.output)
            assert isinstance(res.exception, SystemExit)  # a clean message, no traceback
            msg = json.loads(res.stdout)["message"]
            kind = flag.lstrip("-")
            assert f"spec 'matmul': unknown {kind} '{bad}'" in msg, msg
            assert ("'tf32'" if kind == "precision" else "'split_k4'") in msg  # the known names


def test_nothing_checked_exits_3_with_reasons(specs_dir: Path) -> None:
    gpu_only = str(specs_dir / "gpu_only_spec.py")
    for mode in ("check", "bench"):
        res = runner.invoke(app, ["kernel", mode, gpu_only, "--device", "cpu", *(FAST if mode == "bench" else []), "--json"])
        assert res.exit_code == 3, (mode, res.output)
        out = json.loads(res.stdout)
        assert out["checked"] == 0 and not out["ok"]
        assert out["skipped"] == ["spec 'gpu_only' is GPU-only; skipped on cpu"]
        assert out["feedback"]["error"].startswith("nothing was checked: spec 'gpu_only' is GPU-only")
    res = runner.invoke(app, ["kernel", "check", gpu_only, "--device", "cpu"], env={"COLUMNS": "200"})
    assert res.exit_code == 3
    assert "is GPU-only; skipped on cpu" in res.stdout and "NOTHING CHECKED" in res.stdout and "ok" not in res.stdout.split()


def test_cuda_without_gpu_checks_nothing_and_says_so(specs_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "matmul_spec.py"), "--device", "cuda", "--json"])
    assert res.exit_code == 3, res.output
    out = json.loads(res.stdout)
    assert out["checked"] == 0 and "no CUDA device" in out["skipped"][0]


def test_seeds_help_says_one_set_for_all_shapes() -> None:
    for mode in ("check", "bench"):
        res = runner.invoke(app, ["kernel", mode, "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
        assert res.exit_code == 0
        text = " ".join(res.stdout.replace("│", " ").split())
        assert "shared by every shape and dtype" in text and "per shape" not in text, text
