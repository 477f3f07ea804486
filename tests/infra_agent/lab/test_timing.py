"""The timing logic that runs without a GPU: the launch-hiding delay, host time and
the launch-bound finding from given numbers.  The GPU side is in test_gpu.py."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from infra_agent.cli.main import app
from infra_agent.lab.findings import (
    LAUNCH_BOUND,
    bench_feedback_parts,
    launch_bound,
)
from infra_agent.lab.microbench import BenchEntry, BenchReport
from infra_agent.lab.timing import (
    MAX_DELAY_US,
    MIN_DELAY_US,
    _summarise,
    cycles_for,
    delay_us_for,
    host_burst,
    time_cpu,
    with_host,
)

# The H200 case: a Triton decode step at 17 µs of GPU time, 130 µs per call on the host.
GPU_S = [17e-6, 17.2e-6, 16.9e-6, 17.1e-6, 17.0e-6, 17.3e-6]
HOST_S = [130e-6, 128e-6, 133e-6, 131e-6, 129e-6, 135e-6]


def _gpu_timing(gpu: list[float], host: list[float]):  # type: ignore[no-untyped-def]
    return with_host(_summarise(gpu, "cuda_events_delayed", 10), host)


def test_delay_is_a_multiple_of_the_host_call_within_bounds() -> None:
    assert delay_us_for(40e-6) == pytest.approx(100.0)  # 2.5x a 40 µs call
    assert delay_us_for(1e-6) == MIN_DELAY_US  # a fast host still gets the floor
    assert delay_us_for(1.0) == MAX_DELAY_US  # a slow wrapper does not stall the run
    assert delay_us_for(40e-6, factor=3.0) == pytest.approx(120.0)


def test_cycles_from_the_measured_clock() -> None:
    assert cycles_for(100.0, 1980.0) == 198_000  # 100 µs at 1.98 GHz
    assert cycles_for(20.0, 345.0) == 6_900  # an idle clock: fewer cycles for the same time
    assert cycles_for(1e-9, 1.0) == 1  # never zero: _sleep(0) would be no delay at all


def test_host_burst_times_each_call() -> None:
    samples = host_burst(lambda: time.sleep(1e-3), 5)
    assert len(samples) == 5 and all(s >= 1e-3 for s in samples)


def test_host_fields_in_the_dict_and_backward_compatible() -> None:
    cpu = time_cpu(lambda: None, budget_s=0.01).to_dict()
    old_keys = {"median_s", "best_s", "ci_low_s", "ci_high_s", "n", "method", "warmup", "batch", "notes"}
    assert old_keys <= cpu.keys() and cpu["host_s"] is None and cpu["launch_ratio"] is None
    gpu = _gpu_timing(GPU_S, HOST_S).to_dict()
    assert old_keys <= gpu.keys() and gpu["method"] == "cuda_events_delayed"
    host = gpu["host_s"]
    assert host["n"] == len(HOST_S) and host["median_s"] == pytest.approx(130.5e-6)
    assert host["ci_low_s"] <= host["median_s"] <= host["ci_high_s"]
    assert gpu["launch_ratio"] == pytest.approx(130.5 / 17.05, rel=1e-3)


def test_launch_bound_only_when_host_clearly_exceeds_gpu() -> None:
    assert launch_bound(_gpu_timing(GPU_S, HOST_S))
    assert not launch_bound(_gpu_timing(HOST_S, GPU_S))  # a big kernel: the GPU is the bottleneck
    assert not launch_bound(_summarise(GPU_S, "perf_counter_ns", 3))  # no host figure (the CPU path)
    # Overlapping intervals (host ~ GPU): run-to-run noise, not a finding.
    assert not launch_bound(_gpu_timing([10e-6, 12e-6, 14e-6, 16e-6], [11e-6, 13e-6, 15e-6, 17e-6]))


def _report(timing) -> BenchReport:  # type: ignore[no-untyped-def]
    entry = BenchEntry("kernel", "fp32", "N=8,H=4", "float32", "timed", timing=timing)
    return BenchReport("kda_decode", "spec.py", "cuda", [], entries=[entry])


def test_launch_bound_finding_says_by_how_much_and_what_to_do() -> None:
    ms, fs = bench_feedback_parts(_report(_gpu_timing(GPU_S, HOST_S)))
    (f,) = [f for f in fs if f.kind == LAUNCH_BOUND]
    assert f.severity == "warning" and f.location is not None
    assert (f.location.kernel, f.location.variant, f.location.precision) == ("kda_decode", "kernel", "fp32")
    assert f.evidence["ratio"] == pytest.approx(130.5 / 17.05, rel=1e-3)
    assert f.evidence["host_overhead_s"] == pytest.approx(113.45e-6, rel=1e-3)
    assert "130 µs" in f.message and "17.1 µs" in f.message and "7.65x" in f.message
    q = f.next_question or ""
    assert "CUDA graph" in q and "launch arguments" in q and "fuse" in q
    host = next(m for m in ms if m.name == "host_time")
    assert host.unit == "s" and host.better == "lower" and host.value == pytest.approx(130.5e-6)
    assert host.tags["variant"] == "kernel" and host.tags["knob"] == "precision=fp32"
    _, fs = bench_feedback_parts(_report(_gpu_timing(HOST_S, GPU_S)))
    assert not [f for f in fs if f.kind == LAUNCH_BOUND]


def test_bench_table_has_a_host_column_and_flags_launch_bound() -> None:
    from infra_agent.cli.kernel import _render_bench

    out = io.StringIO()
    _render_bench(Console(file=out, width=250), _report(_gpu_timing(GPU_S, HOST_S)))
    text = out.getvalue()
    assert "host µs" in text and "130.5 launch-bound" in text
    assert "launch-bound kernel fp32 [N=8,H=4]" in text and "CUDA graph" in text


def test_cpu_bench_json_carries_the_host_key(specs_dir: Path) -> None:
    fast = ["--budget-s", "0.02", "--copy-mib", "4", "--matmul-n", "128", "--seeds", "1"]
    res = CliRunner().invoke(app, ["kernel", "bench", str(specs_dir / "matmul_spec.py"), "--device", "cpu",
                                   "--precision", "fp32", "--variant", "kernel", *fast, "--json"])
    assert res.exit_code == 0, res.output
    (entry,) = json.loads(res.stdout)["reports"][0]["entries"]
    # The CPU path is unchanged: wall clock, and no separate host figure.
    assert entry["timing"]["method"] == "perf_counter_ns" and entry["timing"]["host_s"] is None
    assert "launch_bound" not in {f["kind"] for f in json.loads(res.stdout)["feedback"]["findings"]}
