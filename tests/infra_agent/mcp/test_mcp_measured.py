"""The MCP session shows all it measured (issue #38 item 4), through the ``mcp`` package's client on a real refstack.

- ``run_experiment``'s structured result carries both sides' metrics (one row per metric,
  the baseline's and the candidate's values) and each side's findings, labelled; its text
  names both sides; ``read_findings(side=both)`` labels each finding;
- ``run_probe`` measures an experiment's code (its accepted commit), not only the tree;
- ``analyze_trace`` and ``diff_traces`` read a probe's saved traces again;
- ``read_file`` returns code that names tokens and keys as written, while a secret of the
  server's environment never appears in any text, structured result or progress message;
- the client example of docs/mcp.md runs as written against the installed ``mcp`` package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from infra_agent.ledger import Ledger

from ..agent.loop_workspace import FAST_DIFF, make_workspace
from .test_mcp_server import connect, data, err, text

SECRET = "sk-mcp-measured-0123456789abcdef"
# Source lines that masking keyed on words used to turn into ***.
CODE_LINES = ("token_ids = tokenizer.encode(prompt)", "per_token_ms = elapsed_ms / max(len(token_ids), 1)",
              "batch.sort(key=lambda r: r.arrival)", 'next_token = "tok_0123456789"')
# Exits 0 only on code whose engine step is the fast one (FAST_DIFF's).
FAST_CHECK = [sys.executable, "-c", "import sys, tuning; print(tuning.STEP_DELAY_MS); sys.exit(tuning.STEP_DELAY_MS != 3)"]


def _workspace(tmp_path: Path) -> Path:
    # max_running 1 under 4 concurrent chats: both sides queue, so both have findings to label;
    # the trace knob lets the timeline probe turn refstack's spans on.
    ws = make_workspace(tmp_path / "ws", command=[
        sys.executable, "serve.py", "--port", "{port}", "--max-running", "{max_running}", "--trace", "{trace}"],
        extra_knobs={
            "max_running": {"type": "int", "min": 1, "max": 64, "default": 1, "components": ["engine.scheduler"]},
            "trace": {"type": "bool", "default": False, "components": ["server"], "help": "spans for /debug/trace"}})
    (ws / "engine_notes.py").write_text("\n".join(CODE_LINES) + f"\nSERVICE_KEY_FALLBACK = '{SECRET}'\n")
    return ws


@pytest.mark.slow
def test_the_session_shows_both_sides_experiment_code_and_traces(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    seen: list[str] = []  # every text, structured result and progress message the client got

    async def progress(value: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")

    async def call(s: Any, name: str, args: dict[str, Any]) -> Any:
        res = await s.call_tool(name, args, progress_callback=progress)
        seen.extend([text(res), json.dumps(data(res))])
        return res

    async def main() -> dict[str, Any]:
        async with connect(ws, "--budget-runs", "2", env={"MY_SERVICE_TOKEN": SECRET}) as s:
            res = await call(s, "read_file", {"path": "engine_notes.py"})
            assert not err(res) and "***" in text(res), text(res)
            for line in CODE_LINES:
                assert line in text(res), line

            res = await call(s, "run_experiment", {
                "statement": "A 3 ms engine step instead of 30 ms raises output throughput",
                "metric": "output_throughput", "direction": "higher", "min_effect": 0.3, "scenario": "chat",
                "locality": {"component": "engine.loop"}, "diff": FAST_DIFF})
            assert not err(res), text(res)
            exp = data(res)
            assert exp["id"] == "e1" and exp["verdict"]["accepted"] and not exp["topped_up"], text(res)
            assert exp["sides"]["baseline"]["experiment"] == "e0" and exp["sides"]["candidate"]["experiment"] == "e1"
            tput = next(r for r in exp["metrics"] if r["name"] == "output_throughput" and r["tags"].get("scenario") == "chat")
            assert tput["baseline"]["median"] > 0 and tput["candidate"]["median"] > 0 and tput["ratio"] > 1, tput
            assert tput["ratio"] == pytest.approx(tput["candidate"]["median"] / tput["baseline"]["median"])
            sides = {f["side"] for f in exp["findings"]}
            assert sides == {"baseline", "candidate"}, exp["findings"]
            body = text(res)
            assert "baseline (e0)" in body and "candidate (e1)" in body
            assert f"{tput['baseline']['median']:.4g} -> {tput['candidate']['median']:.4g}" in body, body

            res = await call(s, "read_findings", {"experiment": "e1", "side": "both"})
            rows = data(res)["findings"]
            assert not err(res) and {r["side"] for r in rows} == {"baseline", "candidate"}, text(res)
            assert all(line.startswith(("- baseline: ", "- candidate: ")) for line in text(res).splitlines()[1:])

            # The working tree still has the slow step; e1's commit has the fast one.
            res = await call(s, "run_probe", {"probe": "command", "config": {"command": FAST_CHECK}})
            assert err(res) and data(res)["code"]["experiment"] is None, text(res)
            res = await call(s, "run_probe", {"probe": "command", "config": {"command": FAST_CHECK}, "experiment": "e1"})
            assert not err(res) and data(res)["call"] == "p2" and "e1's commit" in text(res), text(res)
            e1_commit = data(res)["code"]["commit"]

            timeline = {"lead_s": 0, "sample_process": "server", "scenarios": ["chat"]}
            slow = await call(s, "run_probe", {"probe": "timeline", "config": timeline})
            fast = await call(s, "run_probe", {"probe": "timeline", "config": timeline, "experiment": "e1"})
            assert not err(slow) and not err(fast), text(slow) + text(fast)
            assert any(a["kind"] == "trace" for a in data(fast)["artifacts"])

            res = await call(s, "analyze_trace", {"probe_call": "p4"})
            assert not err(res), text(res)
            report = data(res)["report"]
            assert report["threads"] and report["duration_us"] > 0 and data(res)["files"], data(res)
            assert "trace of run_probe call p4" in text(res)

            res = await call(s, "diff_traces", {"baseline": {"probe_call": "p3"}, "candidate": {"probe_call": "p4"}})
            assert not err(res), text(res)
            diff = data(res)["diff"]
            delay = next(r for r in diff["spans"] if r["key"] == "step_delay")
            # Per window the slow tree sleeps 30 ms a step, e1's code 3 ms: its self time fell.
            assert delay["b_us"] < delay["a_us"], delay
            assert "A = run_probe call p3" in text(res) and "step_delay" in text(res)

            res = await call(s, "analyze_trace", {"probe_call": "p9"})
            assert err(res) and "p1, p2, p3, p4" in text(res), text(res)
            res = await call(s, "diff_traces", {"baseline": {"probe_call": "p3"}})
            assert err(res) and "candidate" in text(res), text(res)
            return {"run": exp["run"], "e1_commit": e1_commit}

    out = anyio.run(main)
    with Ledger.for_workspace(ws) as ledger:
        e1 = ledger.get_experiment("e1", out["run"])
    assert e1.commit == out["e1_commit"]
    assert seen and not [m for m in seen if SECRET in m]
    assert any("***" in m for m in seen)


@pytest.mark.slow
def test_the_documented_client_runs_an_experiment_and_prints_both_sides(tmp_path: Path) -> None:
    # The example of docs/mcp.md, as written, against the installed mcp package.
    doc = (Path(__file__).resolve().parents[3] / "docs" / "mcp.md").read_text()
    section = doc.split("## A client in Python", 1)[1]
    script = tmp_path / "client.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    ws = _workspace(tmp_path)
    # The mcp client starts the server with a clean environment (a safe subset of variables, no
    # PYTHONPATH), and `python -m` imports from the working directory first: run it from this
    # checkout's src, so the server is the code under test.
    src = Path(__file__).resolve().parents[3] / "src"
    proc = subprocess.run([sys.executable, str(script), str(ws)], capture_output=True, text=True, timeout=600,
                          check=False, cwd=src)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    result = next(line for line in lines if line.startswith("e1 "))
    assert result.split()[1] in ("supported", "refuted", "inconclusive"), proc.stdout
    tput = next(line for line in lines if line.startswith("output_throughput "))
    before, after = (float(x) for x in tput.rsplit(": ", 1)[1].split(" -> "))
    assert before > 0 and after > 0
    assert any(line.startswith("[baseline] queue_dominates_ttft") for line in lines), proc.stdout
    assert any(line.startswith("  .. ") for line in lines)  # its progress callback was called
