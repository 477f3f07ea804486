"""The records every layer shares: what the agent proposes, runs, decides and stores.

:mod:`infra_agent.records.gate` (``GateSpec``, ``GateResult``),
:mod:`infra_agent.records.experiment` (``Hypothesis``, ``Change``, ``Step``, ``Verdict``,
``Experiment``) and :mod:`infra_agent.records.run` (``RunRecord``), :mod:`infra_agent.records.loop_state`
(``LoopState``, what a proposer reads), re-exported here
(import from here).  Records import nothing above them: ``feedback`` and the leaf modules.
"""

from __future__ import annotations

from infra_agent.records.experiment import (
    FINISHED,
    Change,
    Cost,
    Direction,
    Experiment,
    Hypothesis,
    ProbeCall,
    RecordOutcome,
    Status,
    Step,
    Verdict,
    VerdictOutcome,
)
from infra_agent.records.gate import (
    COUNT_METRICS,
    EXACT_COUNT,
    GateKind,
    GateOutcome,
    GateResult,
    GateSpec,
    Op,
    parse_gate_text,
)
from infra_agent.records.loop_state import LoopState
from infra_agent.records.run import RunRecord, RunStatus

__all__ = ["COUNT_METRICS", "EXACT_COUNT", "FINISHED", "Change", "Cost", "Direction", "Experiment", "GateKind", "GateOutcome",
           "GateResult", "GateSpec", "Hypothesis", "LoopState", "Op", "ProbeCall", "RecordOutcome", "RunRecord", "RunStatus", "Status",
           "Step", "Verdict", "VerdictOutcome", "parse_gate_text"]
