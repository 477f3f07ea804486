"""examples/quantization: its playbook decides the two changes its README discusses.

The run itself (``infra-agent run examples/quantization --playbook
examples/quantization/playbook.yaml --pairs 10``, a few minutes on the ``small`` preset) is
recorded in docs/quantization.md; its serving A/B needs more time and a quieter machine than a
test has.  Here: the playbook's two fixed steps come in order, each once, as the loop would ask
for them, with the speed hypothesis the workspace's criterion judges.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.rules import RulesProposer, load_playbook
from infra_agent.records import Experiment, Hypothesis, RunRecord
from infra_agent.workspace import load_workspace

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "quantization"


def test_the_playbook_proposes_w8a8_then_bf16_gemms_once_each() -> None:
    ws = load_workspace(EXAMPLE)
    run = RunRecord(id="r", workspace=str(ws.root), proposer="rules", started_at=time.time())
    best = Experiment(id="e0", run_id="r", seq=0, role="baseline",
                      hypothesis=Hypothesis(statement="b", metric="-", direction="higher"), knobs=dict(ws.resolve_knobs()))
    state = LoopState(workspace=ws, run=run, best=best, history=[best], feedback=[])
    proposer = RulesProposer(load_playbook(EXAMPLE / "playbook.yaml"))
    steps = [proposer.propose(state) for _ in range(3)]
    assert steps[2] is None  # each fixed step fires once
    assert [s.change.knobs for s in steps[:2] if s] == [{"quantization": "w8a8"}, {"dtype": "bfloat16"}]
    speed = next(c for c in ws.criteria if c.name == "decode-speed")
    for step in steps[:2]:
        assert step is not None
        h = step.hypothesis
        assert (h.metric, h.direction) == (speed.metric, "higher") and h.min_effect == pytest.approx(speed.ratio - 1.0)
