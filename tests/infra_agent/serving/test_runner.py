"""Workspace mode: the target lifecycle launches the fake server; a crash mid-run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.probes.base import ProbeContext
from infra_agent.probes.serving import ServingProbe
from infra_agent.serving.runner import run_on_target, run_workspace_scenario
from infra_agent.target import open_target
from infra_agent.workspace import load_workspace


def test_workspace_scenario_with_knob_override(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = load_workspace(fake_workspace())
    res = run_workspace_scenario(ws, "small", {"token_delay_ms": "5"}, log_dir=tmp_path / "logs", progress=False,
                                 output=tmp_path / "r.json")
    assert res["ok"] and res["completed"] == 10 and res["scenario"] == "small"
    assert res["knobs"] == {"token_delay_ms": 5.0}
    assert res["median_tpot_ms"] >= 4.0  # the knob reached the server: 5 ms per token
    assert res["server_metrics"]["e2e"]["count"] == 10
    assert (tmp_path / "r.json").is_file()


def test_server_killed_mid_run_fails_that_run_and_keeps_earlier(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # 1 warmup + 10 measured requests survive; the server crashes inside the second window.
    ws = load_workspace(fake_workspace("--mode die-after --die-after 14"))
    sc = ws.scenario("small")
    results = []
    with open_target(ws, ws.resolve_knobs(), tmp_path / "logs") as target:
        for _ in range(2):
            results.append(run_on_target(target, sc, scenario_name="small", progress=False))
    first, second = results
    assert first["ok"] and first["completed"] == 10 and first["failed"] == 0
    assert second["ok"] is False
    assert "died" in second["error"]
    assert "simulated crash after 14 requests" in second["log_tail"]
    assert second["log_path"]


def test_serving_probe_feedback_keeps_runs_before_a_crash(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = load_workspace(fake_workspace("--mode die-after --die-after 14"))
    fb = ServingProbe().run({"repeats": 3, "percentiles": [50, 99]}, ProbeContext(workdir=tmp_path / "probe", workspace=ws, progress=False))
    assert fb.tier.value == "e2e"
    thr = fb.measurement("output_throughput", scenario="small")
    assert "knob" not in thr.tags  # only knobs off their defaults are tagged
    assert thr.summary is not None and thr.summary.n == 1  # the run before the crash
    ttft = fb.measurement("ttft_ms", scenario="small")
    assert ttft.summary is not None and ttft.summary.n == 10 and ttft.better == "lower"
    assert fb.measurement("server_e2e_mean_ms", scenario="small").tags["interval"] == "e2e"
    kinds = [f.kind for f in fb.findings]
    assert "run_failed" in kinds
    crash = next(f for f in fb.findings if f.kind == "run_failed")
    assert "simulated crash" in crash.evidence["log_tail"]
    assert sum(a.kind == "result" for a in fb.artifacts) == 2
    assert "run_failed" in fb.render_text()


def test_serving_probe_findings_on_url(fake_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The fake server reports 1 ms queue time per request; with a 0.5 ms TTFT budget
    # that cannot be dominant, so use a tiny queue_share to check the finding's wiring.
    cfg = {"url": fake_server.url, "metrics_url": fake_server.metrics_url,
           "scenario": {"dataset": {"kind": "random", "input_len": 8, "output_len": 4}, "num_requests": 6},
           "queue_share": 0.0001}
    fb = ServingProbe().run(cfg, ProbeContext(workdir=tmp_path, progress=False))
    assert fb.ok, fb.error
    q = next(f for f in fb.findings if f.kind == "queue_dominates_ttft")
    assert q.evidence["queue_ms"] == pytest.approx(1.0)


def test_serving_probe_on_url_keeps_windows_before_an_error(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A bare URL has no process to watch; its /metrics not answering after the window
    # marks that window failed (with what it measured), and the one before it stays.
    srv = fake_server_factory("--mode", "die-after", "--die-after", "14")
    cfg = {"url": srv.url, "metrics_url": srv.metrics_url, "repeats": 3,
           "scenario": {"dataset": {"kind": "random", "input_len": 8, "output_len": 4}, "num_requests": 10}}
    fb = ServingProbe().run(cfg, ProbeContext(workdir=tmp_path, progress=False))
    thr = fb.measurement("output_throughput", scenario="inline")
    assert thr.summary is not None and thr.summary.n == 1
    results = [json.loads(Path(a.path).read_text()) for a in fb.artifacts if a.kind == "result"]
    assert [r["ok"] for r in results] == [True, False]  # the third window was not tried
    assert "metrics could not be scraped" in results[1]["error"] and results[1]["failed"] >= 8
