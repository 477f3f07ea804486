"""``examples/tp-numerics-e2e`` under the agent loop (the rules proposer), reduced.

The path the scenario exists for: the baseline (TP=2, tf32 LM head) misses the
"TP=2 matches TP=1" criteria; the kernel lab localises the disagreement to the LM head
under tf32; the playbook's rule moves the knob to 3xtf32; the criteria pass.  The
workspace is the example's file, copied beside the kernel spec it names, with a
shorter serving scenario (the criteria are about numbers, not speed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra_agent.ledger import Ledger

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.slow
@pytest.mark.timeout(900)  # the loop starts ~10 servers; 3-4 min on two busy cores
def test_the_rules_proposer_takes_the_case_a_path_to_passing_gates(tmp_path: Path) -> None:
    (tmp_path / "tp-numerics").mkdir()
    shutil.copy2(EXAMPLES / "tp-numerics" / "spec.py", tmp_path / "tp-numerics" / "spec.py")
    ws = tmp_path / "tp-numerics-e2e"
    ws.mkdir()
    spec = yaml.safe_load((EXAMPLES / "tp-numerics-e2e" / "infra-agent.yaml").read_text())
    spec["scenarios"]["decode"].update(num_requests=4, warmup_requests=1)
    (ws / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (ws / ".gitignore").write_text(".infra-agent/\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "workspace"]):
        subprocess.run(["git", *args], cwd=ws, check=True, env={**env, "PATH": "/usr/bin:/bin"})
    proc = subprocess.run([sys.executable, "-m", "infra_agent.cli.main", "run", str(ws), "--proposer", "rules",
                           "--budget-runs", "2", "--no-report", "--json"],
                          capture_output=True, text=True, timeout=900, check=False, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)
    assert run["status"] == "done" and run["message"] == "every gate passes", run["message"]
    before = {g["name"]: g["outcome"] for g in run["gates_before"]}
    after = {g["name"]: g["outcome"] for g in run["gates_after"]}
    # The fp32-level logprob criterion and the kernel check fail at the baseline (the
    # greedy-token one may pass, fail or be inconclusive: a top-1 flip needs a near tie).
    assert before["tp2-logprobs-fp32-level"] == "fail" and before["lm-head-tp-agreement"] == "fail", run["gates_before"]
    assert set(after.values()) == {"pass"}, run["gates_after"]
    with Ledger.for_workspace(ws) as ledger:
        accepted = [e for e in ledger.experiments(run["id"]) if e.role == "experiment" and e.verdict.accepted]
    assert [e.change.knobs for e in accepted] == [{"lm_head_precision": "3xtf32"}], accepted
    kernel = accepted[0]
    assert kernel.probe is not None and (kernel.probe.name, kernel.probe.tier.value) == ("kernel", "check")
    assert "restores TP agreement" in kernel.hypothesis.statement
    assert kernel.hypothesis.locality.precision == "3xtf32" and kernel.hypothesis.locality.component == "model.lm_head"
