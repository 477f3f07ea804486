"""The Quick start's main job: `infra-agent demo` end to end, as a user runs it.

The demo is a real agent run: the rules proposer reads the baseline's findings, the
planner sends the kernel question to the kernel lab and the scheduler question to an
interleaved A/B, and the judge decides.  This test checks what the demo must show.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infra_agent.agent.executors.cleanup import marked_pids


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 2 minutes alone; beside the rest of the suite on 2 cores, up to 5
def test_demo_fixes_the_failing_gates_from_the_findings(tmp_path: Path) -> None:
    workdir = tmp_path / "ws"
    proc = subprocess.run(
        [sys.executable, "-m", "infra_agent.cli.main", "demo", "--workdir", str(workdir), "--json"],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    run = out["run"]
    # The workspace is a committed git repository generated from refstack's knob list.
    assert (workdir / "infra-agent.yaml").is_file() and (workdir / ".git").is_dir()
    before = {g["name"]: g["outcome"] for g in run["gates_before"]}
    after = {g["name"]: g["outcome"] for g in run["gates_after"]}
    # The mis-set baseline fails every gate; the run ends with every gate passing,
    # measured side by side against the baseline.
    assert before == {"chat-throughput": "fail", "chat-p90-ttft": "fail", "lm-head-tp-agreement": "fail"}, run["gates_before"]
    assert after == {"chat-throughput": "pass", "chat-p90-ttft": "pass", "lm-head-tp-agreement": "pass"}, run["gates_after"]
    assert sorted(out["fixed"]) == ["chat-p90-ttft", "chat-throughput", "lm-head-tp-agreement"]
    # The loop stops as soon as the accepted path's table passes ("every gate passes"); on a
    # loaded machine a gate of that path can stay inconclusive until the confirmation's pairs
    # decide it, and the loop stops when the playbook has nothing left ("...; every gate
    # passes").  Either way the conclusion says so only from the final, measured table.
    assert run["status"] == "done" and run["message"].endswith("every gate passes"), run["message"]
    exps = {e["id"]: e for e in out["experiments"]}
    accepted = [e for e in exps.values() if e["accepted"] and e["role"] == "experiment"]
    # Case study A as a kernel-tier experiment (no deployment), then the scheduler
    # hypothesis as an interleaved e2e A/B: each follows from a finding.
    kernel = next(e for e in accepted if e["change"] == {"lm_head_precision": "3xtf32"})
    assert (kernel["probe"], kernel["tier"], kernel["verdict"]) == ("kernel", "check", "supported")
    assert "restores TP agreement" in kernel["hypothesis"]
    sched = next(e for e in accepted if "max_running" in e["change"])
    assert (sched["probe"], sched["tier"], sched["verdict"]) == ("serving", "e2e", "supported")
    assert "batch slot" in sched["hypothesis"] and sched["change"]["max_running"] > 2
    assert any(e["role"] == "confirm" and e["verdict"] == "confirmed" for e in exps.values())
    html = Path(out["report"]["html"])
    assert html.is_file() and run["id"] in html.read_text()
    assert Path(out["report"]["markdown"]).is_file()
    # Nothing left behind: no marked process, no worktree.
    assert marked_pids(run["id"] + "/") == []
    assert not (workdir / ".infra-agent" / "worktrees" / run["id"]).exists()
    wt = subprocess.run(["git", "worktree", "list"], cwd=workdir, capture_output=True, text=True, check=True).stdout
    assert len(wt.strip().splitlines()) == 1
