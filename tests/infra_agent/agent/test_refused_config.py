"""A configuration the server refuses, through the real loop: refuted with the engine's line, its
launches counted, and never run again, on any parent.

The workspace's command puts a stand-in engine (``tests/infra_agent/refusing_engine.py``) in
front of a real refstack: it checks ``max_batch_tokens`` against ``max_running`` as vLLM checks
``max_num_batched_tokens`` against ``max_num_seqs``, exits with a traceback when the check fails,
and otherwise hands over to refstack.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infra_agent.agent.executors.cleanup import marked_pids
from infra_agent.agent.executors.local import LocalExecutor
from infra_agent.agent.proposers.llm_prompt import experiment_result
from infra_agent.ledger import Ledger
from infra_agent.records import Change, Hypothesis, Step
from infra_agent.report import render_markdown
from infra_agent.vocabulary import FindingKind

from .fake_executor import Script, loop_for, new_run, workspace
from .loop_workspace import FAST_DIFF

pytestmark = pytest.mark.slow

ENGINE = Path(__file__).resolve().parents[1] / "refusing_engine.py"
COMMAND = [sys.executable, str(ENGINE), "--port", "{port}", "--max-num-seqs", "{max_running}",
           "--max-num-batched-tokens", "{max_batch_tokens}", "--",
           sys.executable, "serve.py", "--port", "{port}", "--max-running", "{max_running}",
           "--max-batch-tokens", "{max_batch_tokens}"]
BATCH_TOKENS = {"max_batch_tokens": {"type": "int", "min": 1, "max": 65536, "default": 512,
                                     "components": ["engine.scheduler"], "help": "Token budget of one engine step."}}


def _step(statement: str, change: Change, min_effect: float = 0.1) -> Step:
    return Step(hypothesis=Hypothesis(statement=statement, metric="output_throughput", direction="higher",
                                      min_effect=min_effect, scenario="chat"), change=change)


def test_a_refused_configuration_is_refuted_counted_and_never_run_again(tmp_path: Path) -> None:
    ws = workspace(tmp_path, command=COMMAND, extra_knobs=BATCH_TOKENS)
    too_few = Change(knobs={"max_batch_tokens": 2})
    steps: list[Step | Exception] = [
        _step("a step of two tokens keeps the batch short and raises throughput", too_few),
        _step("cutting the step cost from 30 to 3 ms raises throughput", Change(diff=FAST_DIFF), min_effect=0.2),
        _step("two tokens a step, on the faster code", too_few),
    ]
    with Ledger.for_workspace(ws.root) as ledger:
        run = new_run(tmp_path, ledger, look_again=False)
        executor = LocalExecutor(ws, run.id, pairs=3, timeout_s=300, check_timeout_s=120)
        try:
            loop_for(ws, ledger, run, Script(steps), executor).execute()
        finally:
            executor.cleanup()
        exps = ledger.experiments(run.id)
        base = next(e for e in exps if e.role == "baseline")
        refused, faster, again = (e for e in exps if e.role == "experiment")
        findings = ledger.findings(refused.id, run_id=run.id)  # the ledger's findings table
    assert base.status == "done" and base.cost.launches >= 1, (base.status, base.error)

    # Refuted, not failed: the verdict and the finding quote the engine's own line.
    said = "ValueError: max_num_batched_tokens (2) is smaller than max_num_seqs"
    assert refused.status == "done" and refused.error is None
    assert refused.verdict is not None and refused.verdict.outcome == "refuted" and not refused.accepted
    assert said in refused.verdict.message and "exit code 1" in refused.verdict.message
    found = [f for f in findings if f.kind == FindingKind.SERVER_REFUSED_CONFIG]
    assert len(found) == 1, [f.kind for f in findings]
    finding = found[0]
    assert finding.evidence["reason"].startswith(said) and finding.evidence["exit_code"] == 1
    assert finding.evidence["knobs"] == {"max_batch_tokens": 2}
    assert finding.evidence["baseline"] == {"max_batch_tokens": base.knobs["max_batch_tokens"]}
    assert f"max_batch_tokens=2 (baseline {base.knobs['max_batch_tokens']})" in finding.message
    assert finding.location is not None and finding.location.knob == "max_batch_tokens"
    assert "Traceback" in Path(finding.evidence["log"]).read_text()

    # No benchmark ran, but both servers were started: the parent's, then the refusing one.
    assert refused.cost.e2e_runs == 0 and refused.cost.launches >= 2
    cost = f"0 e2e runs, {refused.cost.launches} launches"
    assert cost in experiment_result(refused, 8000) and said in experiment_result(refused, 8000)
    assert cost in render_markdown(run, exps)

    # The code change became the best, and the refused configuration on it was screened out.
    assert faster.accepted and faster.commit is not None, faster.verdict
    assert again.parent == faster.id != refused.parent
    assert again.status == "rejected" and again.probe is None and again.cost.launches == 0
    assert f"already tried in experiment {refused.id} and the server refused it: {said}" in (again.error or "")
    assert marked_pids(run.id + "/") == []
