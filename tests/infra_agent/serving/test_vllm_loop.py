"""The loop on a live vLLM: one experiment with servers reused, and a configuration vLLM refuses.

The workspace is ``examples/vllm-serving`` on the tiny random Llama (bench/tune_vllm.py's),
without its constraint, so the refused configuration reaches vLLM as it would in a
workspace that did not declare the rule.  A scripted proposer hands out the two steps; the
executor is the real one, with the server pool on: the baseline's server is kept for the
second experiment and each configuration is launched once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.records import Change, Hypothesis, Step
from infra_agent.vocabulary import FindingKind

from ..agent.fake_executor import Script, loop_for, new_run
from .vllm_live import MARKS, ROOT, make_tiny_model, set_vllm_env

pytestmark = MARKS


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory)


@pytest.fixture
def vllm_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return set_vllm_env(monkeypatch)


def _step(statement: str, knobs: dict[str, int]) -> Step:
    return Step(hypothesis=Hypothesis(statement=statement, metric="output_throughput", direction="higher",
                                      min_effect=0.1, scenario="short-chat"), change=Change(knobs=knobs))


def test_a_loop_experiment_reuses_servers_and_a_refusal_quotes_vllm(tmp_path: Path, tiny_model: Path,
                                                                   vllm_env: dict[str, str]) -> None:
    from tune_vllm import make_workspace

    from infra_agent.agent.executors.local import LocalExecutor
    from infra_agent.ledger import Ledger
    from infra_agent.workspace import load_workspace

    # A small window (16 chats of 32 + 16 tokens, 8 at once): a loaded 2-core machine ran
    # max_num_seqs=2 at 3 tokens/s.
    ws = load_workspace(make_workspace(tmp_path / "ws", tiny_model, max_num_seqs=2, max_num_batched_tokens=2048,
                                       constraints=False, num_requests=16, max_concurrency=8, input_len=32,
                                       output_len=16))
    steps: list[Step | Exception] = [
        _step("8 running sequences instead of 2 batch the 8 chats in flight: throughput up", {"max_num_seqs": 8}),
        # Inside the knobs' domains (a step budget of at least 16) but below the sequence cap: vLLM refuses it.
        _step("a step of 16 tokens keeps decode steps short", {"max_num_seqs": 32, "max_num_batched_tokens": 16}),
    ]
    with Ledger.for_workspace(ws.root) as ledger:
        # keep_going: the gate may pass after the first experiment on a quiet machine; the second still runs.
        run = new_run(tmp_path, ledger, look_again=False, top_up=False, keep_going=True)
        # The machine is shared: windows are not re-run for other jobs' CPU; the intervals carry it.
        executor = LocalExecutor(ws, run.id, pairs=3, timeout_s=1800, check_timeout_s=600, max_foreign_cpu=None,
                                 reuse_servers=True)
        try:
            loop_for(ws, ledger, run, Script(steps), executor).execute()
        finally:
            executor.cleanup()
        exps = ledger.experiments(run.id)
        base = next(e for e in exps if e.role == "baseline")
        more, refused = (e for e in exps if e.role == "experiment")
        findings = ledger.findings(refused.id, run_id=run.id)
    assert base.status == "done" and base.cost.launches == 1, (base.status, base.error, base.cost)

    # Reuse: the baseline's server served the experiment's baseline side; only the candidate launched.
    assert more.status == "done" and more.cost.launches == 1 and more.cost.e2e_runs >= 6, (more.error, more.cost)
    # Four times the running sequences under 8 chats in flight: more throughput, whatever the
    # load does to the interval (3.2x [1.6, 6.3] at load average 25-36).
    assert more.verdict is not None and more.verdict.outcome in ("supported", "inconclusive"), more.verdict
    assert more.verdict.effect is not None and more.verdict.effect > 1.0, more.verdict

    # vLLM's own reason, not "exit code 1": the last line of its traceback.
    assert refused.verdict is not None and refused.verdict.outcome == "refuted" and not refused.accepted
    assert refused.cost.e2e_runs == 0 and refused.cost.launches == 1, refused.cost
    found = [f for f in findings if f.kind == FindingKind.SERVER_REFUSED_CONFIG]
    assert len(found) == 1, [f.kind for f in findings]
    reason = found[0].evidence["reason"]
    assert "max_num_batched_tokens" in reason and "max_num_seqs" in reason, reason
    assert reason in refused.verdict.message

    # Launches per configuration: the baseline, max_num_seqs=8, the refused one (32 / 16); never again.
    assert sum(e.cost.launches for e in exps) == 3, [(e.id, e.cost.launches) for e in exps]


def test_the_example_takes_the_builds_defaults(tmp_path: Path, vllm_env: dict[str, str]) -> None:
    """``knobs_from_help.py --write`` puts the installed build's own defaults into the workspace."""
    import shutil
    import subprocess
    import sys

    from infra_agent.target import vllm_build
    from infra_agent.workspace import load_workspace


    ws = tmp_path / "vllm-serving"
    shutil.copytree(ROOT / "examples" / "vllm-serving", ws)
    done = subprocess.run([sys.executable, str(ws / "knobs_from_help.py"), "--write", str(ws / "infra-agent.yaml")],
                          capture_output=True, text=True, env=vllm_env, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    want = vllm_build.batch_defaults(vllm_env)
    if vllm_build.probe(vllm_build.interpreter(vllm_env) or "python", vllm_env).device == "cpu":  # type: ignore[union-attr]
        assert (want["max_num_seqs"], want["max_num_batched_tokens"]) == (128, 2048), want  # vLLM's CPU server defaults
    knobs = load_workspace(ws).knobs
    assert (knobs["max_num_seqs"].default, knobs["max_num_batched_tokens"].default) == (
        want["max_num_seqs"], want["max_num_batched_tokens"])
    assert f"vLLM {want['version']}'s own default" in (ws / "infra-agent.yaml").read_text()


def test_vllms_refusal_is_its_own_error_line(tmp_path: Path, tiny_model: Path, vllm_env: dict[str, str]) -> None:
    """One launch vLLM refuses, outside the loop: the start fails with vLLM's line, not the exit code."""
    from tune_vllm import make_workspace

    from infra_agent.errors import ServerExitedEarly
    from infra_agent.target.server import ServerProcess
    from infra_agent.workspace import load_workspace

    ws = load_workspace(make_workspace(tmp_path / "ws", tiny_model, max_num_seqs=32, max_num_batched_tokens=16,
                                       constraints=False))
    server = ServerProcess(ws.target, ws.resolve_knobs(), tmp_path / "logs", root=ws.root)
    with pytest.raises(ServerExitedEarly) as info:
        server.start()
    server.stop()
    reason = info.value.reason or ""
    assert "max_num_batched_tokens" in reason and "max_num_seqs" in reason and "Traceback" not in reason, reason
