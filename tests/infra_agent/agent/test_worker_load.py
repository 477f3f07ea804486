"""Serving windows under foreign load are run again: the executor worker on a real refstack.

The foreign load is a busy-loop process this test starts (``while True: pass``); the
machine is shared with other work, so the tests assert what the busy loop causes, never
that a quiet window stays quiet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from infra_agent.agent.executors.worker import run_ab_job, run_repeat_job

from .loop_workspace import make_workspace

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc")]


def _start_busy_loop() -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.2)  # past the interpreter's start: spinning
    return proc


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait()


@contextmanager
def busy_loop() -> Iterator[subprocess.Popen[bytes]]:
    proc = _start_busy_loop()
    try:
        yield proc
    finally:
        _stop(proc)


def _ab_job(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    yaml = make_workspace(tmp_path / "ws") / "infra-agent.yaml"
    return {"kind": "ab", "workspace_a": str(yaml), "workspace_b": str(yaml), "knobs_a": {}, "knobs_b": {"max_running": 2},
            "scenarios": ["chat"], "pairs": 1, "workdir": str(tmp_path / "out"), "percentiles": [50], **extra}


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _host(fb: dict[str, Any]) -> dict[str, Any]:
    return dict(fb["meta"]["host"])


def _prompt_set(fb: dict[str, Any]) -> int:
    """The prompt set the window drew (serving/prompt_sets.py), as its Feedback records it."""
    (window,) = fb["meta"]["prompts"]
    return int(window["window"])


def test_a_pair_loaded_by_a_busy_loop_is_run_again_whole(tmp_path: Path) -> None:
    """The worker as the executor runs it; a busy loop starts after pair 0's first window
    and stops when the worker announces the re-run."""
    # The threshold explicitly: the suite's conftest turns the default off (INFRA_AGENT_MAX_FOREIGN_CPU).
    job = _ab_job(tmp_path, pairs=2, max_foreign_cpu=0.5)
    job_path, result_path = tmp_path / "job.json", tmp_path / "result.json"
    job_path.write_text(json.dumps(job))
    worker = subprocess.Popen([sys.executable, "-m", "infra_agent.agent.executors.worker", str(job_path), str(result_path)],
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True, text=True)
    loop: subprocess.Popen[bytes] | None = None
    events: list[dict[str, Any]] = []
    try:
        assert worker.stdout is not None
        for line in worker.stdout:
            event = json.loads(line)
            events.append(event)
            if event["event"] == "run" and (event["pair"], event["attempt"], event["side"]) == (0, 0, "a"):
                loop = _start_busy_loop()  # side B of pair 0 runs beside it
            elif event["event"] == "rerun" and loop is not None:
                _stop(loop)
                loop = None
        assert worker.wait(timeout=60) == 0
    finally:
        _stop(loop)
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)  # the worker stops its servers on SIGTERM
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
    out = json.loads(result_path.read_text())
    assert "error" not in out, out.get("error")
    reruns = [e for e in events if e["event"] == "rerun"]
    assert reruns and (reruns[0]["pair"], reruns[0]["attempt"], reruns[0]["scenario"]) == (0, 1, "chat"), events
    # Pair 0's first attempt was discarded whole: both sides, B for its load, A with its pair.
    first = {d["side"]: d for d in out["discarded"] if (d["pair"], d["attempt"]) == (0, 0)}
    assert set(first) == {"a", "b"}
    assert first["b"]["foreign_cpu"] > 0.5 and first["b"]["reason"].startswith("foreign_cpu ")
    assert first["b"]["feedback"]["meta"]["host"]["foreign_cpu"] == first["b"]["foreign_cpu"]
    # Pairing holds: one kept window per side and pair, in the job's order.
    assert len(out["a"]["chat"]) == len(out["b"]["chat"]) == 2
    for side in ("a", "b"):
        kept = _host(out[side]["chat"][0])
        assert kept["reruns"] >= 1 and len(kept["discarded_foreign_cpu"]) == kept["reruns"]
        assert kept["discarded_foreign_cpu"][0] == first[side]["foreign_cpu"]
        names = {m["name"]: m for m in out[side]["chat"][0]["measurements"]}
        assert names["host_foreign_cpu"]["unit"] == "cores" and names["host_load_1m"]["unit"] == "load"
    assert all(len([d for d in out["discarded"] if (d["pair"], d["attempt"]) == (p, a)]) == 2
               for p, a in {(d["pair"], d["attempt"]) for d in out["discarded"]})


def test_a_pair_loaded_throughout_is_kept_marked_after_two_reruns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with busy_loop():
        out = run_ab_job(_ab_job(tmp_path, max_foreign_cpu=0.3))
    assert "error" not in out, out.get("error")
    reruns = [e for e in _events(capsys.readouterr().out) if e["event"] == "rerun"]
    assert [e["attempt"] for e in reruns] == [1, 2]
    assert out["max_foreign_cpu"] == 0.3
    assert sorted((d["attempt"], d["side"]) for d in out["discarded"]) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    assert len(out["a"]["chat"]) == len(out["b"]["chat"]) == 1
    kept = {side: _host(out[side]["chat"][0]) for side in ("a", "b")}
    assert all(h["reruns"] == 2 and len(h["discarded_foreign_cpu"]) == 2 for h in kept.values())
    assert any(h.get("loaded") for h in kept.values())
    assert all(h["foreign_cpu"] > 0.3 for h in kept.values() if h.get("loaded"))
    # Every attempt sent prompts of its own (its servers had seen the discarded attempt's),
    # both sides of the pair the same ones.
    drawn = {(d["side"], d["attempt"]): _prompt_set(d["feedback"]) for d in out["discarded"]}
    drawn.update({(side, 2): _prompt_set(out[side]["chat"][0]) for side in ("a", "b")})
    assert [drawn[("a", k)] for k in range(3)] == [drawn[("b", k)] for k in range(3)] == [0, 1, 2]
    assert out["prompt_sets_used"] == 3


def test_max_foreign_cpu_none_never_reruns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with busy_loop():
        out = run_ab_job(_ab_job(tmp_path, max_foreign_cpu=None))
    assert "error" not in out, out.get("error")
    assert out["discarded"] == [] and out["max_foreign_cpu"] is None
    assert out["prompt_sets_used"] == 1 and _prompt_set(out["a"]["chat"][0]) == _prompt_set(out["b"]["chat"][0]) == 0
    assert not [e for e in _events(capsys.readouterr().out) if e["event"] == "rerun"]
    for side in ("a", "b"):
        host = _host(out[side]["chat"][0])
        assert host["reruns"] == 0 and "loaded" not in host
        assert host["source"] == "proc" and host["foreign_cpu"] > 0.3  # measured and recorded all the same


def test_repeat_job_reruns_a_loaded_window(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    yaml = make_workspace(tmp_path / "ws") / "infra-agent.yaml"
    job = {"kind": "repeat", "workspace": str(yaml), "knobs": {}, "scenarios": ["chat"], "repeats": 1,
           "workdir": str(tmp_path / "out"), "percentiles": [50], "max_foreign_cpu": 0.3}
    with busy_loop():
        out = run_repeat_job(job)
    assert "error" not in out, out.get("error")
    assert [e["attempt"] for e in _events(capsys.readouterr().out) if e["event"] == "rerun"] == [1, 2]
    assert [(d["side"], d["attempt"]) for d in out["discarded"]] == [("b", 0), ("b", 1)]
    (kept,) = out["b"]["chat"]
    host = _host(kept)
    assert host["loaded"] is True and host["reruns"] == 2 and host["foreign_cpu"] > 0.3
