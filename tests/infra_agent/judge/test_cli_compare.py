from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
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


def test_compare_single_runs_decide_nothing_unless_per_request(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(100, 1.0, rng)))
    b.write_text(json.dumps(_run(100, 1.5, rng)))
    args = ["compare", str(a), str(b), "--criterion", "median_ttft_ms<=1.1", "--criterion", "output_throughput>=0.95"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps at the terminal width
    assert "INCONCLUSIVE median_ttft_ms<=1.1: one run per side" in text
    assert "repeat the runs interleaved (A B A B ...) to >= 3 per side (2 more each)" in text
    assert "INCONCLUSIVE output_throughput>=0.95" in text
    assert "per-request bootstrap" not in text

    # --per-request shows an interval from the requests of the two runs, labelled, and still
    # decides nothing: requests of one run are not independent samples of the server.
    res = runner.invoke(app, [*args, "--per-request"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "INCONCLUSIVE median_ttft_ms<=1.1" in text and "describes these two runs only" in text
    assert "FAIL" not in text and "more samples would likely decide it" not in text  # runs decide, not requests
    assert "INCONCLUSIVE output_throughput>=0.95" in text  # throughput has no per-request samples
    assert "per-request bootstrap: ignores between-run variance" in text
    data = json.loads(runner.invoke(app, [*args, "--per-request", "--json"]).stdout)
    assert data["per_request"] is True and "per-request bootstrap: ignores between-run variance" in data["warnings"][0]


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


def _write(path: Path, content: object) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


@pytest.mark.parametrize(("content", "extra", "fragment"), [
    (bytes(range(256)), [], "not a readable result JSON (a binary file"),
    ({"runs": 5}, [], "`runs` is a number (5); expected a non-empty list of result objects"),
    ({"runs": []}, [], "`runs` is an empty list"),
    ([], [], "an empty list; expected a benchmark result object"),
    ("just text", [], "holds a string; expected a benchmark result object"),
    ({}, [], "not a benchmark result, as it has no `completed` count (an empty object)"),
    ({"completed": "many"}, [], "`completed` is 'many'; expected the number of completed requests"),
    ({"runs": [{"ok": True, "completed": 3, "output_throughput": 1.0}, 7]}, [], "runs[1]: a number; expected a result object"),
    (None, ["--confidence", "1.5"], "--confidence: expected a number between 0 and 1 (exclusive), e.g. 0.95; got 1.5"),
    (None, ["--n-boot", "0"], "--n-boot: expected at least 100 bootstrap replicates (default 2000); got 0"),
    (None, ["--metric", "median_ttf_ms"], "no metric 'median_ttf_ms'; did you mean median_ttft_ms?"),
    (None, ["--metric", "request_goodput"], "request_goodput is None (request_goodput is null when the run had no SLO)"),
])
def test_compare_user_errors_exit_2_with_the_file_and_the_problem(tmp_path: Path, content, extra: list[str], fragment: str) -> None:
    good = {**_run(100, 1.0, np.random.default_rng(0)), "request_goodput": None}
    a = _write(tmp_path / "a.json", good if content is None else content)
    b = _write(tmp_path / "b.json", good)
    res = runner.invoke(app, ["compare", str(a), str(b), *extra])
    assert res.exit_code == 2, res.output
    flat = " ".join(res.stderr.split())
    assert fragment in flat
    if content is not None:
        assert f"A (baseline) file {a}".replace(" ", "") in flat.replace(" ", "")
    assert "Traceback" not in res.output
    js = runner.invoke(app, ["compare", str(a), str(b), *extra, "--json"])
    assert js.exit_code == 2 and json.loads(js.stdout)["error"] == "BenchmarkError"


def test_compare_reports_a_failed_side(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    good = _write(tmp_path / "good.json", {"runs": [_run(t, 1.0, rng) for t in (100, 101, 99)]})
    dead = _write(tmp_path / "dead.json", {"runs": [{"ok": False, "error": "server exited (code 1)"}] * 3})
    res = runner.invoke(app, ["compare", str(good), str(dead), "--criterion", "output_throughput>=0.95"])
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "B (candidate) FAILED" in text and "server exited (code 1)" in text
    assert "FAIL output_throughput>=0.95: B (candidate) failed: none of its 3 runs succeeded" in text
    assert "INCONCLUSIVE" not in text

    res = runner.invoke(app, ["compare", str(dead), str(good), "--criterion", "output_throughput>=0.95", "--json"])
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert set(data["failed"]) == {"A"}
    assert data["verdicts"][0]["outcome"] == "inconclusive"
    assert data["verdicts"][0]["message"].startswith("A (baseline) failed: ")
    # the default metrics are still listed, with the side that ran
    assert [m["metric"] for m in data["metrics"]][:2] == ["output_throughput", "request_throughput"]
    assert data["metrics"][0]["candidate"] == pytest.approx(100)


def test_compare_refuses_different_workloads(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    header = {"model_id": "m", "endpoint": "completions", "num_prompts": 50, "max_concurrency": 8, "request_rate": "inf",
              "burstiness": 1.0, "dataset": {"kind": "random", "input_len": 64, "output_len": 32, "range_ratio": 0.0, "seed": 0}}
    a = _write(tmp_path / "a.json", {"runs": [{**_run(t, 1.0, rng), **header} for t in (100, 101, 99)]})
    other = {**header, "max_concurrency": 16, "dataset": {**header["dataset"], "seed": 3}}
    b = _write(tmp_path / "b.json", {"runs": [{**_run(t, 1.0, rng), **other} for t in (100, 101, 99)]})
    res = runner.invoke(app, ["compare", str(a), str(b)])
    assert res.exit_code == 2, res.output
    flat = " ".join(res.stderr.split())
    assert "ran different workloads" in flat and "max_concurrency: A 8, B 16" in flat and "dataset.seed: A 0, B 3" in flat
    assert "--allow-mismatch" in flat

    res = runner.invoke(app, ["compare", str(a), str(b), "--allow-mismatch"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "warning: A and B ran different workloads (--allow-mismatch): max_concurrency: A 8, B 16; dataset.seed: A 0, B 3" in text
    data = json.loads(runner.invoke(app, ["compare", str(a), str(b), "--allow-mismatch", "--json"]).stdout)
    assert data["workload_mismatch"] == ["max_concurrency: A 8, B 16", "dataset.seed: A 0, B 3"]
    # the same workload on both sides passes the check
    same = _write(tmp_path / "same.json", {"runs": [{**_run(t, 1.0, rng), **header} for t in (100, 101, 99)]})
    assert runner.invoke(app, ["compare", str(a), str(same)]).exit_code == 0
