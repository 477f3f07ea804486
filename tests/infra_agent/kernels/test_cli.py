from __future__ import annotations

import json
from pathlib import Path

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
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "splitk_bug_spec.py"), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    failed = [r for r in out["reports"][0]["results"] if r["status"] == "failed"]
    assert failed and all(r["precision"] == "tf32" and r["stats"]["worst_index"] for r in failed)


def test_check_text_table(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "faulty_kernels_spec.py"), "--spec-name", "wrong_shape"], env={"COLUMNS": "200"})
    assert res.exit_code == 1
    assert "FAIL" in res.stdout and "wrong shape" in res.stdout


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
    res = runner.invoke(app, ["kernel", "bench", str(specs_dir / "kda_decode_spec.py"), "--device", "cpu", *FAST], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.output
    assert "ceilings measured in this run" in res.stdout and "work accounting" in res.stdout and "l2norm_qk" in res.stdout


def test_broken_spec_exit_2(specs_dir: Path) -> None:
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "broken" / "bad_factory_spec.py"), "--json"])
    assert res.exit_code == 2
    err = json.loads(res.stdout)
    assert err["error"] == "KernelSpecError" and "bad_factory" in err["message"] and "variant 'inputs'" in err["message"]
