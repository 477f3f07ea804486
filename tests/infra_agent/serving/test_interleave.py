from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.judge.verdict import compare_runs, parse_gate
from infra_agent.serving.interleave import interleave, interleave_knobs, interleave_urls
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
    # Runs of ~0.1 s (fast side) and 4 pairs: with 10 tokens a run was ~30 ms, and one
    # scheduling stall on this shared box could make one pair of three look even.
    sc = Scenario.model_validate({"dataset": {"kind": "random", "input_len": 8, "output_len": 24}, "num_requests": 8, "max_concurrency": 4})
    runs = interleave_urls(fast.url, slow.url, sc, pairs=4)
    assert runs.order == ["a", "b"] * 4
    comp = compare_runs(*runs.complete_pairs(), ["output_throughput", "median_tpot_ms"], [parse_gate("output_throughput>=0.95")])
    thr = comp.metrics[0]
    assert thr.source == "per-run" and thr.ci is not None and thr.ci.paired
    assert thr.ci.high < 0.8  # 3x slower tokens: far below 1
    assert comp.verdicts[0].outcome == "fail"
    runs.write(tmp_path / "a.json", tmp_path / "b.json")
    assert len(json.loads((tmp_path / "b.json").read_text())["runs"]) == 4


def test_interleaved_knobs_start_both_servers(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = load_workspace(fake_workspace(num_requests=6))
    runs = interleave_knobs(ws, {"token_delay_ms": 2}, {"token_delay_ms": 8}, pairs=2, log_dir=tmp_path / "logs")
    assert [r["knobs"]["token_delay_ms"] for r in runs.a] == [2.0, 2.0]
    assert [r["knobs"]["token_delay_ms"] for r in runs.b] == [8.0, 8.0]
    assert min(r["median_tpot_ms"] for r in runs.b) > max(r["median_tpot_ms"] for r in runs.a)


def test_interleaved_knobs_restart_fresh_servers_per_block(fake_workspace, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ws = load_workspace(fake_workspace(num_requests=4))
    seen: list[tuple[str, int]] = []
    runs = interleave_knobs(ws, {"token_delay_ms": 2}, {"token_delay_ms": 4}, pairs=3, restarts=2,
                            log_dir=tmp_path / "logs", on_run=lambda side, i, r: seen.append((side, i)))
    # 3 pairs over 2 restarts: one pair, then two, each block on two fresh servers.
    assert [r["restart"] for r in runs.a] == [r["restart"] for r in runs.b] == [0, 1, 1]
    assert seen == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert len(list((tmp_path / "logs").glob("*.log"))) == 4  # one log per started server
    # Every run must have succeeded for the judge to see both blocks; if one did not, say why.
    failed = [(side, i, r.get("error")) for side, rs in (("a", runs.a), ("b", runs.b))
              for i, r in enumerate(rs) if not r.get("ok", True)]
    assert failed == []
    comp = compare_runs(*runs.complete_pairs(), ["output_throughput"], process_noise=0.01)
    assert comp.metrics[0].ci is not None and comp.metrics[0].ci.restarts == 2
    with pytest.raises(ValueError, match="restarts"):
        interleave_knobs(ws, {}, {}, pairs=2, restarts=3)
