from __future__ import annotations

import json
from pathlib import Path

from infra_agent.judge.interleave import interleave, interleave_knobs, interleave_urls
from infra_agent.judge.verdict import parse_gate
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Scenario


def test_order_and_failed_pairs_dropped() -> None:
    calls: list[str] = []

    def mk(side: str):  # type: ignore[no-untyped-def]
        def run() -> dict:
            calls.append(side)
            ok = not (side == "b" and calls.count("b") == 2)  # B's second run fails
            return {"ok": ok, "completed": 1, "output_throughput": 1.0} if ok else {"ok": False, "error": "x"}
        return run

    runs = interleave(mk("a"), mk("b"), 3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    a, b = runs.complete_pairs()
    assert len(a) == len(b) == 2
    calls.clear()
    interleave(mk("a"), mk("b"), 3, order="abba")
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_interleaved_urls_detect_a_slower_server(fake_server_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fast = fake_server_factory("--token-delay-ms", "3")
    slow = fake_server_factory("--token-delay-ms", "9")
    sc = Scenario.model_validate({"dataset": {"kind": "random", "input_len": 8, "output_len": 10}, "num_requests": 8, "max_concurrency": 4})
    runs = interleave_urls(fast.url, slow.url, sc, pairs=3)
    assert runs.order == ["a", "b"] * 3
    comp = runs.judge(["output_throughput", "median_tpot_ms"], [parse_gate("output_throughput>=0.95")])
    thr = comp.metrics[0]
    assert thr.source == "per-run" and thr.ci is not None and thr.ci.paired
    assert thr.ci.high < 0.8  # 3x slower tokens: far below 1
    assert comp.verdicts[0].outcome == "fail"
    runs.write(tmp_path / "a.json", tmp_path / "b.json")
    assert len(json.loads((tmp_path / "b.json").read_text())["runs"]) == 3


def test_interleaved_knobs_start_both_servers(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = load_workspace(fake_workspace(num_requests=6))
    runs = interleave_knobs(ws, {"token_delay_ms": 2}, {"token_delay_ms": 8}, pairs=2, log_dir=tmp_path / "logs")
    assert [r["knobs"]["token_delay_ms"] for r in runs.a] == [2.0, 2.0]
    assert [r["knobs"]["token_delay_ms"] for r in runs.b] == [8.0, 8.0]
    assert min(r["median_tpot_ms"] for r in runs.b) > max(r["median_tpot_ms"] for r in runs.a)
