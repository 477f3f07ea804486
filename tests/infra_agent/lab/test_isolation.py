"""Checks run in a worker process: a kernel that hangs or kills its process is a
finding for its variant, the other calls still run, and nothing is left running."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.errors import KernelSpecError
from infra_agent.lab import progress as lab_progress
from infra_agent.lab.correctness import KERNEL, check_spec
from infra_agent.lab.loader import load_specs, select
from infra_agent.lab.progress import LabProgress
from infra_agent.probes import ProbeContext
from infra_agent.probes.kernel import KernelProbe, run_lab
from infra_agent.vocabulary import FindingKind

runner = CliRunner()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process whose parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _our_workers() -> list[int]:
    """Worker processes started by this process that are still running."""
    me = str(os.getpid())
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "infra_agent.lab.worker" in args and args[-1] == me and _running(int(d.name)):
            found.append(int(d.name))
    return found


def test_hung_and_crashing_variants_are_findings_and_the_rest_runs(
    specs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("HANG_SPEC_PIDFILE", str(pidfile))
    monkeypatch.setattr(lab_progress, "PLAIN_INTERVAL_S", 0.5)
    start = time.monotonic()
    res = runner.invoke(app, ["kernel", "check", str(specs_dir / "hang_spec.py"), "--spec-name", "hang", "--timeout-s", "2", "--json"])
    elapsed = time.monotonic() - start
    assert res.exit_code == 1, res.output
    assert elapsed < 60, elapsed  # one 2 s timeout and two fresh workers, not 600 s of sleep
    out = json.loads(res.stdout)
    (report,) = out["reports"]
    assert report["timeout_s"] == 2 and report["notes"] == []
    status = {r["variant"]: (r["status"], r["fault"]) for r in report["results"]}
    # The variants after the hung and the crashed one still ran, in fresh workers.
    assert status == {
        KERNEL: ("passed", None), "ok_before": ("passed", None), "sleeps": ("failed", "timeout"),
        "exits": ("failed", "crashed"), "ok_after": ("passed", None),
    }
    fb = out["feedback"]
    assert fb["error"] == "2 failed checks (1 timed out, 1 crashed)"
    assert fb["meta"]["timed_out"] == 1 and fb["meta"]["crashed"] == 1
    (timeout,) = [f for f in fb["findings"] if f["kind"] == FindingKind.KERNEL_TIMEOUT]
    ev = timeout["evidence"]
    assert (ev["variant"], ev["precision"], ev["shape"], ev["dtype"], ev["seed"], ev["timeout_s"]) == ("sleeps", "fp32", "N=16", "float32", 1, 2)
    assert timeout["location"]["variant"] == "sleeps" and timeout["location"]["precision"] == "fp32"
    assert "within 2 s" in timeout["message"] and "--timeout-s" in timeout["next_question"]
    (crash,) = [f for f in fb["findings"] if f["kind"] == FindingKind.KERNEL_ERROR]
    assert crash["location"]["variant"] == "exits" and "exit code 3" in crash["message"]
    # The hung worker, the helper it started, and the crashed worker are all gone.
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 3 and not [p for p in pids if _running(p)]
    assert _our_workers() == []
    # Without a terminal, progress came as plain lines on stderr.
    assert "kernel check: spec hang, " in res.stderr and "/5 calls, " in res.stderr


def test_hung_kernel_leaves_variants_without_baseline_under_spec_timeout(specs_dir: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    fb = KernelProbe().run({"spec": str(specs_dir / "hang_spec.py"), "spec_name": "hang_kernel"}, ProbeContext(workdir=tmp_path, progress=False))
    assert time.monotonic() - start < 60
    assert not fb.ok and fb.meta["timed_out"] == 1
    (timeout,) = [f for f in fb.findings if f.kind == FindingKind.KERNEL_TIMEOUT]
    # No --timeout-s: the spec's own timeout_s (1.5 s) applies, not the 60 s default.
    assert timeout.evidence["variant"] == KERNEL and timeout.evidence["timeout_s"] == 1.5
    report = json.loads(Path(fb.artifacts[0].path).read_text())[0]
    (shard,) = [r for r in report["results"] if r["variant"] == "ok_shard"]
    assert shard["status"] == "skipped" and "did not return within 1.5 s" in shard["message"]
    assert _our_workers() == []


def test_hung_reference_is_a_spec_error(specs_dir: Path) -> None:
    specs = select(load_specs(specs_dir / "hang_spec.py"), "hang_reference")
    with pytest.raises(KernelSpecError, match=r"spec 'hang_reference', reference: did not return within 1 s .*shape=\[N=16\]"):
        run_lab(specs, "check", {"timeout_s": 1, "device": "cpu"})
    assert _our_workers() == []


def test_one_worker_serves_every_spec_of_a_file(specs_dir: Path) -> None:
    specs = load_specs(specs_dir / "faulty_kernels_spec.py")
    fb, reports = run_lab(specs, "check", {"device": "cpu", "seeds": 1})
    assert fb.meta["checked"] > 0 and fb.meta["timed_out"] == 0
    assert all(r.timeout_s == 60 and r.notes == [] for r in reports)  # type: ignore[union-attr]
    status = {(r.spec, x.variant): x.status for r in reports for x in r.results}  # type: ignore[union-attr]
    assert status[("raises", KERNEL)] == "failed" and status[("good_with_nan_variant", "ok_shard")] == "passed"
    assert _our_workers() == []


def test_timeout_zero_and_specs_built_in_code_run_in_process(specs_dir: Path) -> None:
    (spec,) = load_specs(specs_dir / "matmul_spec.py")
    fb, (report,) = run_lab([spec], "check", {"device": "cpu", "seeds": 1, "precisions": "fp32", "timeout_s": 0})
    assert fb.ok and report.timeout_s is None  # type: ignore[union-attr]
    # A kernel replaced after loading cannot be found in the file by a worker: the
    # check runs here, and says so.
    faulty = select(load_specs(specs_dir / "faulty_kernels_spec.py"), "raises")[0]
    swapped = dataclasses.replace(spec, kernel=faulty.kernel)
    report = check_spec(swapped, seeds=[1], device="cpu", precisions=["fp32"], timeout_s=5)
    assert report.timeout_s is None and "its kernel was replaced after loading" in report.notes[0]
    assert report.results[0].fault == "raised"
    # Replacing data fields keeps the spec isolatable.
    narrowed = dataclasses.replace(spec, shapes=[{"M": 8, "N": 4, "K": 16}], name="small")
    report = check_spec(narrowed, seeds=[1], device="cpu", precisions=["fp32"], timeout_s=30)
    assert report.timeout_s == 30 and report.notes == [] and report.passed
    assert {r.shape for r in report.results} == {"M=8,N=4,K=16"}


def test_plain_progress_lines_are_periodic() -> None:
    stream = io.StringIO()
    with LabProgress("check", interval_s=0.05, stream=stream) as p:
        p("tp_lm_head", 12, 40, "calls")
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("kernel check: spec tp_lm_head, 12/40 calls, ") and lines[-1].endswith(" s")
    quiet = io.StringIO()
    with LabProgress("check", interval_s=5.0, stream=quiet) as p:
        p("matmul", 1, 2)
    assert quiet.getvalue() == ""  # shorter than the interval: nothing printed
