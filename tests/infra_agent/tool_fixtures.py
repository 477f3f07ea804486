"""A tiny code tree (a git repository), a workspace with an endpoint target and a loop state:
the fixtures the tool and llm-proposer tests share (their conftests import them)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from infra_agent.agent.proposers.base import LoopState
from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier
from infra_agent.records import Experiment, GateResult, Hypothesis, RunRecord
from infra_agent.workspace import Workspace, load_workspace

WORKSPACE_YAML = """\
name: tiny
target: {kind: endpoint, url: "http://127.0.0.1:9", model: tiny}
knobs:
  max_running: {type: int, min: 1, max: 256, default: 16, components: [engine.scheduler], help: requests at once}
  precision: {type: choice, choices: [fp32, bf16], default: fp32, components: [model.lm_head]}
scenarios:
  chat:
    dataset: {kind: random, input_len: 32, output_len: 8}
    num_requests: 8
criteria:
  - {name: tput, metric: output_throughput, ratio: 1.05}
"""

ENGINE_PY = """\
class Scheduler:
    def __init__(self, max_running: int = 16) -> None:
        self.max_running = max_running

    def admit(self, waiting: list) -> list:
        return waiting[: self.max_running]
"""


@pytest.fixture
def code_root(tmp_path: Path) -> Path:
    root = tmp_path / "code"
    (root / "src").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "src" / "engine.py").write_text(ENGINE_PY)
    (root / "src" / "server.py").write_text("def serve(port: int) -> None:\n    print('serving', port)\n")
    (root / "tests" / "test_engine.py").write_text("def test_admit() -> None:\n    assert True\n")
    (root / "README.md").write_text("tiny engine\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> Workspace:
    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    (ws_dir / "infra-agent.yaml").write_text(WORKSPACE_YAML)
    return load_workspace(ws_dir)


def baseline() -> Experiment:
    return Experiment(id="e0", run_id="run1", seq=0, proposer="baseline", status="done",
                      hypothesis=Hypothesis(statement="baseline", metric="output_throughput", direction="higher"),
                      knobs={"max_running": 16, "precision": "fp32"})


def feedback() -> Feedback:
    return Feedback(probe="serving", tier=Tier.e2e, scope=["engine"],
                    measurements=[Measurement(name="output_throughput", unit="tok/s", samples=[100.0, 101.0],
                                              better="higher", tags={"scenario": "chat"})],
                    findings=[Finding(kind="queue_dominates_ttft", message="queue time is 80% of TTFT",
                                      location=Location(component="engine.scheduler"),
                                      evidence={"queue_share": 0.8}, next_question="is max_running too low?")])


@pytest.fixture
def state(workspace: Workspace, code_root: Path) -> LoopState:
    base = baseline()
    gate = GateResult(name="tput", gate="output_throughput>=1.05 @chat", kind="relative", outcome="fail",
                      value=1.0, low=0.98, high=1.02)
    return LoopState(workspace=workspace, run=RunRecord(id="run1", workspace=str(workspace.root), proposer="llm",
                                                        started_at=0.0),
                     best=base, history=[base], feedback=[feedback()], gates=[gate], code_root=code_root)
