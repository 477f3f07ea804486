from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from infra_agent.cli.main import app

runner = CliRunner()


def _run(thr: float, ttft_scale: float, rng: np.random.Generator) -> dict:
    n = 50
    ttfts = ttft_scale * rng.lognormal(-3, 0.2, n)
    return {"ok": True, "completed": n, "output_throughput": thr, "request_throughput": thr / 10,
            "median_ttft_ms": float(np.median(ttfts)) * 1e3, "ttfts": ttfts.tolist(), "e2els": (ttfts + 0.5).tolist(),
            "itls": [[0.01] * 4] * n, "output_lens": [5] * n, "errors": [""] * n}


def test_compare_per_run_verdicts_with_intervals(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"runs": [_run(t, 1.0, rng) for t in (100, 102, 98, 101)]}))
    b.write_text(json.dumps({"runs": [_run(t, 1.0, rng) for t in (80, 81, 79, 80)]}))
    res = runner.invoke(app, ["compare", str(a), str(b), "--metric", "output_throughput", "--criterion", "output_throughput>=0.95"])
    assert res.exit_code == 1, res.output  # a failed gate fails the command
    assert "FAIL" in res.output and "output_throughput>=0.95" in res.output
    assert "[0." in res.output  # the interval is printed

    js = runner.invoke(app, ["compare", str(a), str(b), "--metric", "output_throughput", "--criterion", "output_throughput>=0.7", "--json"])
    data = json.loads(js.stdout)
    assert data["verdicts"][0]["outcome"] == "pass"
    ci = data["metrics"][0]["ci"]
    assert ci["low"] <= ci["ratio"] <= ci["high"] and ci["paired"] is True


def test_compare_single_runs_use_per_request_samples(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(100, 1.0, rng)))
    b.write_text(json.dumps(_run(100, 1.5, rng)))
    res = runner.invoke(app, ["compare", str(a), str(b), "--criterion", "median_ttft_ms<=1.1", "--criterion", "output_throughput>=0.95"])
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())  # rich wraps at the terminal width
    assert "FAIL median_ttft_ms<=1.1" in text
    assert "INCONCLUSIVE output_throughput>=0.95" in text
    assert "per-request" in text


def test_compare_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    res = runner.invoke(app, ["compare", str(bad), str(bad)])
    assert res.exit_code == 2 and "not a readable result JSON" in " ".join(res.output.split())


def test_compare_process_noise_counts_restarts_and_widens(tmp_path: Path) -> None:
    # Six pairs from two restarts (labels as interleave_knobs writes them), B 3% faster.
    rng = np.random.default_rng(2)
    runs_a = [{**_run(t, 1.0, rng), "restart": i // 3} for i, t in enumerate((100, 101, 99, 100, 102, 98))]
    runs_b = [{**_run(t, 1.0, rng), "restart": i // 3} for i, t in enumerate((103, 104, 102, 103, 105, 101))]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"runs": runs_a}))
    b.write_text(json.dumps({"runs": runs_b}))
    args = ["compare", str(a), str(b), "--metric", "output_throughput", "--criterion", "output_throughput>1.0", "--json"]
    plain = json.loads(runner.invoke(app, args).stdout)
    noisy = json.loads(runner.invoke(app, [*args, "--process-noise", "0.03"]).stdout)
    assert plain["verdicts"][0]["outcome"] == "pass"  # the runs alone say B is faster...
    # ...but a 3% spread between fresh processes, over 2 restarts, cannot rule out chance.
    assert noisy["verdicts"][0]["outcome"] == "inconclusive"
    ci = noisy["metrics"][0]["ci"]
    assert ci["restarts"] == 2 and ci["process_noise"] == 0.03
    assert ci["high"] - ci["low"] > plain["metrics"][0]["ci"]["high"] - plain["metrics"][0]["ci"]["low"]
    assert "over 2 restart(s)" in noisy["metrics"][0]["note"]
    bad = runner.invoke(app, [*args, "--process-noise", "-1"])
    assert bad.exit_code == 2
