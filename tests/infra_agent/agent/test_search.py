"""The search proposer: Optuna TPE over the knobs, guided by attribution.

No servers: the loop is simulated with a synthetic objective on the example workspace's
knobs, and Feedback is fabricated.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from infra_agent.agent.proposers.base import LoopState, Proposer
from infra_agent.agent.proposers.search import SearchProposer
from infra_agent.agent.proposers.search_objective import (
    Objective,
    distribution,
    metric_value,
    objective_for,
)
from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Location,
    Measurement,
    Tier,
)
from infra_agent.records import (
    Change,
    Experiment,
    GateResult,
    Hypothesis,
    RunRecord,
    Step,
)
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "refstack-serving"
SCENARIO = "short-chat"
TARGET = 950.0
GATE = f"output_throughput>={TARGET:g} @{SCENARIO}"
CALIBRATION = ("step_delay_ms", "step_slowdown")

QUEUE = Finding(
    kind="queue_dominates_ttft", severity="warning", message="requests wait in the queue",
    location=Location(component="engine.scheduler", span="queue"),
    evidence={"queue_ms": 80.0, "ttft_ms": 100.0, "share": 0.8, "scenario": SCENARIO},
)


@pytest.fixture(scope="module")
def ws() -> Workspace:
    return load_workspace(EXAMPLE)


def throughput(c: dict[str, Any]) -> float:
    """A serving engine in miniature: concurrency-bound until 48 running, cache pressure past 96,
    a step budget and a queue cap that can throttle it, thread oversubscription, small chunks."""
    running = min(c["max_running"], c["max_batch_tokens"], c["max_waiting"])
    value = 1000.0 * min(running, 48) / 48
    if c["max_running"] > 96:
        value *= max(0.3, 1 - 0.25 * math.log2(c["max_running"] / 96))
    threads = c["torch_threads"]
    if threads:
        value *= min(threads, 16) / 16 * (1.0 if threads <= 64 else 0.85)
    value *= min(1.0, (c["prefill_chunk"] / 64) ** 0.25)
    value *= {"fp32": 1.0, "tf32": 1.01, "3xtf32": 0.97, "bf16": 1.02}[c["lm_head_precision"]]
    # The calibration knobs slow it down; zero is their best value.
    value *= 1 / (1 + c["step_delay_ms"] / 10) * (1 - c["step_slowdown"])
    return value


def feedback(value: float | None, ttft: list[float] | None = None) -> Feedback:
    if value is None:
        return Feedback(probe="serving", tier=Tier.e2e, ok=False, error="server exited")
    ms = [Measurement.from_samples("output_throughput", "tok/s", [value], better="higher", component="client", scenario=SCENARIO)]
    if ttft is not None:
        ms.append(Measurement.from_samples("ttft_ms", "ms", ttft, better="lower", component="client", scenario=SCENARIO))
    return Feedback(probe="serving", tier=Tier.e2e, measurements=ms)


def baseline(ws: Workspace) -> Experiment:
    knobs = ws.resolve_knobs()
    return Experiment(id="e0", run_id="r1", seq=0, proposer="baseline", status="done", knobs=knobs,
                      hypothesis=Hypothesis(statement="baseline", metric="output_throughput", direction="higher",
                                            min_effect=0.0, scenario=None),
                      feedback=feedback(throughput(knobs)))


def make_state(ws: Workspace, findings: list[Finding], gate_outcome: str = "fail") -> LoopState:
    base = baseline(ws)
    gates = [GateResult(name="chat-throughput", gate=GATE, kind="absolute", outcome=gate_outcome)]  # type: ignore[arg-type]
    return LoopState(workspace=ws, run=RunRecord(id="r1", workspace=str(ws.root), proposer="search", started_at=0.0),
                     best=base, history=[base], gates=gates,
                     feedback=[Feedback(probe="serving", tier=Tier.e2e, findings=findings)])


def run_step(state: LoopState, step: Step, value: float | None, status: str = "done") -> Experiment:
    seq = len(state.history)
    knobs = {**state.best.knobs, **step.change.knobs}
    return Experiment(id=f"e{seq}", run_id="r1", seq=seq, parent=state.best.id, proposer="search", status=status,  # type: ignore[arg-type]
                      hypothesis=step.hypothesis, change=step.change, knobs=knobs,
                      feedback=feedback(value) if status == "done" else None)


def simulate(ws: Workspace, proposer: SearchProposer, budget: int, findings: list[Finding],
             objective: Any = throughput) -> tuple[int, list[Step], LoopState]:
    """propose/observe cycles; the judge is idealised: a 5% better value is accepted as the new best.

    Returns the trial at which the target was reached (budget + 1 when never), the steps, the state.
    """
    state = make_state(ws, findings)
    best_value = throughput(state.best.knobs)
    steps: list[Step] = []
    reached = budget + 1
    for i in range(budget):
        step = proposer.propose(state)
        if step is None:
            break
        steps.append(step)
        config = {**state.best.knobs, **step.change.knobs}
        value = objective(config)
        exp = run_step(state, step, value)
        state.history.append(exp)
        proposer.observe(state, exp)
        if value is not None and value >= best_value * 1.05:
            state.best, best_value = exp, value
        if value is not None and value >= TARGET and reached > budget:
            reached = i + 1
            break
    return reached, steps, state


# ---------------------------------------------------------------- objective and feedback


def test_objective_is_the_first_failing_criterion_gate(ws: Workspace) -> None:
    gates = [
        GateResult(name="c", gate="check lm-head-tp", kind="check", outcome="fail"),
        GateResult(name="p", gate="total_token_throughput>=0.95 @long-prefill", kind="relative", outcome="pass"),
        GateResult(name="t", gate="p99_ttft_ms<=1.1 @short-chat x baseline", kind="relative", outcome="fail"),
    ]
    assert objective_for(ws, gates) == Objective("p99_ttft_ms", "lower", "short-chat")
    # No failing gate: the first criterion.
    assert objective_for(ws, gates[1:2]) == Objective("total_token_throughput", "higher", "long-prefill")


def test_metric_value_from_measurements_samples_and_results(tmp_path: Path) -> None:
    ttft = [float(i) for i in range(1, 101)]
    fb = feedback(700.0, ttft)
    assert metric_value(fb, "output_throughput", SCENARIO) == 700.0
    assert metric_value(fb, "output_throughput", "long-prefill") is None  # another scenario
    assert metric_value(fb, "p99_ttft_ms", SCENARIO) == pytest.approx(99.01)
    assert metric_value(fb, "median_ttft_ms", SCENARIO) == pytest.approx(50.5)
    assert metric_value(fb, "mean_ttft_ms", SCENARIO) == pytest.approx(50.5)
    assert metric_value(fb, "p50_tpot_ms", SCENARIO) is None  # no tpot samples
    # A result key that is no measurement comes from the probe's result files.
    for i, v in enumerate((1200.0, 1000.0, 1100.0)):
        path = tmp_path / f"serving-{SCENARIO}-{i}.json"
        path.write_text(json.dumps({"total_token_throughput": v}))
        fb.artifacts.append(Artifact(kind="result", path=str(path), description=f"{SCENARIO} run {i}"))
    assert metric_value(fb, "total_token_throughput", SCENARIO) == 1100.0
    assert metric_value(fb, "total_token_throughput", "short") is None
    assert metric_value(feedback(None), "output_throughput", SCENARIO) is None
    # Throughput: the mean over windows (the judge's statistic); untagged measurements serve any scenario.
    windows = Feedback(probe="serving", tier=Tier.e2e, measurements=[
        Measurement.from_samples("output_throughput", "tok/s", [100.0, 200.0, 600.0], better="higher")])
    assert metric_value(windows, "output_throughput", SCENARIO) == 300.0
    # A number in meta (kernel probes) counts even when the probe failed.
    assert metric_value(Feedback(probe="k", tier=Tier.micro, ok=False, meta={"failed_checks": 2}), "failed_checks") == 2.0


def test_distributions_follow_the_domains(ws: Workspace) -> None:
    d = distribution(ws.knobs["max_running"])
    assert d is not None and d.log and (d.low, d.high) == (1, 4096)  # type: ignore[attr-defined]
    d = distribution(ws.knobs["torch_threads"])  # min 0: uniform
    assert d is not None and not d.log  # type: ignore[attr-defined]
    d = distribution(ws.knobs["lm_head_precision"])
    assert d is not None and list(d.choices) == ["fp32", "tf32", "3xtf32", "bf16"]  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the proposer


def test_is_a_proposer_and_states_a_hypothesis(ws: Workspace) -> None:
    p = SearchProposer(seed=0)
    assert isinstance(p, Proposer) and p.name == "search"
    state = make_state(ws, [QUEUE])
    step = p.propose(state)
    assert step is not None
    h = step.hypothesis
    assert (h.metric, h.direction, h.scenario, h.min_effect) == ("output_throughput", "higher", SCENARIO, 0.05)
    assert h.locality == Location(component="engine.scheduler", knob="max_running")
    assert h.statement.startswith("max_running=")
    assert "raises output_throughput (ranked by attribution: queue_dominates_ttft at engine.scheduler)" in h.statement
    # The stage holds the top two knobs; its first step from the best moves the top one alone
    # (x2: a local move), no longer a joint TPE draw of both (issue #35: the search wandered).
    assert set(p.active) == {"max_running", "max_batch_tokens"}
    assert step.change.knobs == {"max_running": 64} and step.change.description.startswith("search local move: ")


def test_attribution_reaches_the_target_in_fewer_trials_than_blind(ws: Workspace) -> None:
    budget = 40
    guided = [simulate(ws, SearchProposer(seed=s), budget, [QUEUE])[0] for s in range(5)]
    blind = [simulate(ws, SearchProposer(seed=s, blind=True), budget, [QUEUE])[0] for s in range(5)]
    print(f"trials to target (budget {budget}): attributed {guided} median {statistics.median(guided)}; "
          f"blind {blind} median {statistics.median(blind)}")
    assert statistics.median(guided) < statistics.median(blind)
    assert statistics.median(guided) <= budget


def test_space_starts_with_the_top_knobs_and_widens_when_stale(ws: Workspace) -> None:
    p = SearchProposer(seed=1, widen_after=3)
    flat = lambda c: 500.0  # nothing ever improves
    _, steps, _ = simulate(ws, p, 12, [QUEUE], objective=flat)
    assert p.stages[0] == ("max_running", "max_batch_tokens")
    assert p.stages[1] == ("max_running", "max_batch_tokens", "max_waiting", "prefill_chunk")
    assert set(p.stages[-1]) == {"max_running", "max_batch_tokens", "max_waiting", "prefill_chunk",
                                 "lm_head_precision", "torch_threads"}
    searched = [set(s.change.knobs) for s in steps]
    # 3 stale trials, then the next knobs: each stage's attributed knobs it adds are first moved
    # alone from the best (local moves, x2), and once 2 of them miss, TPE samples the stage jointly.
    assert searched[:3] == [{"max_running"}, {"max_batch_tokens"}, set(p.stages[0])]
    assert searched[3:6] == [{"max_waiting"}, {"prefill_chunk"}, set(p.stages[1])]
    assert searched[6] == set(p.stages[2])  # the knobs no finding ranks get no local move
    assert p.widenings[0].startswith("added max_waiting, prefill_chunk: 3 trials without improving")
    assert "widened to 4 knobs" in steps[3].hypothesis.statement


def test_default_widen_after_is_four_per_active_knob(ws: Workspace) -> None:
    p = SearchProposer(seed=2)
    _, steps, _ = simulate(ws, p, 9, [QUEUE], objective=lambda c: 500.0)
    # 8 stale trials in the 2-knob stage (2 local moves, then 6 joint TPE trials), then the
    # 4-knob stage, which starts with a local move of a knob it adds.
    assert [len(s.change.knobs) for s in steps] == [1, 1] + [2] * 6 + [1]
    assert set(steps[8].change.knobs) <= set(p.stages[1]) - set(p.stages[0])


def _lm_head_named_at_the_scheduler(tmp_path: Path) -> tuple[Workspace, Finding]:
    """The example with ``lm_head_precision`` on the scheduler, and a queueing finding that names it."""
    text = (EXAMPLE / "infra-agent.yaml").read_text().replace(
        "    choices: [fp32, tf32, 3xtf32, bf16]\n    default: fp32\n    components: [model.lm_head]",
        "    choices: [fp32, tf32, 3xtf32, bf16]\n    default: fp32\n    components: [engine.scheduler]")
    (tmp_path / "infra-agent.yaml").write_text(text)
    return load_workspace(tmp_path), Finding(kind="queue_dominates_ttft", severity="warning", message="m",
                                             location=Location(component="engine.scheduler", knob="lm_head_precision"))


def test_widens_when_a_discrete_space_is_exhausted(tmp_path: Path) -> None:
    ws, named = _lm_head_named_at_the_scheduler(tmp_path)
    p = SearchProposer(seed=0, top_k=1, widen_after=100)
    _, steps, _ = simulate(ws, p, 6, [named], objective=lambda c: 500.0)
    assert p.stages[0] == ("lm_head_precision",)  # the knob a finding names comes first
    # fp32 is the baseline's: three untried choices, then the space is exhausted.
    assert sorted(s.change.knobs["lm_head_precision"] for s in steps[:3]) == ["3xtf32", "bf16", "tf32"]
    assert all(set(s.change.knobs) == {"lm_head_precision"} for s in steps[:3])
    # The widened stage adds max_running, moved alone from the best first (x2: a local move).
    assert p.stages[1] == ("lm_head_precision", "max_running") and steps[3].change.knobs == {"max_running": 64}
    assert p.widenings[0].endswith("every configuration of lm_head_precision tried")


def test_never_repeats_respects_domains_and_never_touches_calibration(ws: Workspace) -> None:
    for blind in (False, True):
        p = SearchProposer(seed=3, blind=blind)
        _, steps, state = simulate(ws, p, 40, [QUEUE], objective=lambda c: 500.0 + c["max_running"] % 7)
        configs = [tuple(sorted(e.knobs.items())) for e in state.history]
        assert len(configs) == len(set(configs))
        for s in steps:
            assert not set(s.change.knobs) & set(CALIBRATION)
            for name, value in s.change.knobs.items():
                assert ws.knobs[name].check(value) == value and type(ws.knobs[name].check(value)) is type(value)
        assert all(e.knobs[k] == 0 for e in state.history for k in CALIBRATION)
        assert not set(p.searchable) & set(CALIBRATION)


def test_blind_searches_every_knob_from_the_first_trial(ws: Workspace) -> None:
    p = SearchProposer(seed=0, blind=True)
    step = p.propose(make_state(ws, [QUEUE]))
    assert step is not None
    assert set(step.change.knobs) == set(ws.knobs) - set(CALIBRATION)
    assert "blind search over all 6 knobs" in step.hypothesis.statement
    assert len(p.stages) == 1


def test_no_finding_moves_each_knob_alone_before_a_joint_draw(ws: Workspace) -> None:
    # No finding ranks a knob (a healthy default): every knob gets its local move from the best,
    # one question per experiment, before TPE samples them jointly (it used to draw all six at
    # once from the first trial: on a live vLLM, max_num_seqs 880 with a 22518-token budget and
    # a bf16 KV cache, in one experiment that could say nothing of any of them).
    p = SearchProposer(seed=0)
    _, steps, _ = simulate(ws, p, 8, [], objective=lambda c: 500.0)
    searched = [set(s.change.knobs) for s in steps]
    n = len(p.stages[0])
    assert n == 6 and "no finding points at a knob" in steps[0].hypothesis.statement
    assert all(len(k) == 1 for k in searched[:n]) and len(set().union(*searched[:n])) == n, searched
    assert all(s.change.description.startswith("search local move: ") for s in steps[:n])
    assert len(searched[n]) > 1, searched  # then TPE, jointly


def test_observe_tells_values_and_failures(ws: Workspace) -> None:
    p = SearchProposer(seed=0)
    state = make_state(ws, [QUEUE])
    for status, value in (("done", 800.0), ("error", None), ("done", None), ("timeout", None)):
        step = p.propose(state)
        assert step is not None
        exp = run_step(state, step, value, status=status)
        state.history.append(exp)
        p.observe(state, exp)
    assert p.study is not None
    mine = [t for t in p.study.trials if not t.user_attrs.get("repeat") and "experiment" not in t.user_attrs]
    assert [t.state for t in mine] == [TrialState.COMPLETE] + [TrialState.FAIL] * 3
    assert mine[0].value == 800.0
    base = next(t for t in p.study.trials if t.user_attrs.get("experiment") == "e0")
    assert base.value == pytest.approx(throughput(state.best.knobs))
    assert p.best_value() == 800.0


def test_a_gate_on_a_latency_percentile_is_minimised(ws: Workspace) -> None:
    p = SearchProposer(seed=0)
    state = make_state(ws, [QUEUE])
    state.gates = [GateResult(name="t", gate=f"p99_ttft_ms<=1.1 @{SCENARIO}", kind="relative", outcome="fail")]
    step = p.propose(state)
    assert step is not None and step.hypothesis.direction == "lower" and "lowers p99_ttft_ms" in step.hypothesis.statement
    exp = run_step(state, step, 1.0).model_copy(update={"feedback": feedback(900.0, [10.0] * 99 + [500.0])})
    state.history.append(exp)
    p.observe(state, exp)
    assert p.study is not None and p.study.direction.name == "MINIMIZE"
    assert p.best_value() == pytest.approx(metric_value(exp.feedback, "p99_ttft_ms", SCENARIO))


def test_restore_rebuilds_the_study_without_losing_or_repeating(ws: Workspace) -> None:
    p = SearchProposer(seed=4, widen_after=3)
    _, steps, state = simulate(ws, p, 10, [QUEUE], objective=lambda c: 400.0 + (c["max_running"] % 11))
    # One experiment was interrupted: it is not finished, so it is no trial (it runs again).
    interrupted = Experiment(id="e99", run_id="r1", seq=99, parent="e0", proposer="search", status="interrupted",
                             hypothesis=steps[0].hypothesis, change=Change(knobs={"max_running": 3, "max_batch_tokens": 5}, diff=None))
    history = [*state.history, interrupted]

    q = SearchProposer(seed=4, widen_after=3)
    q.restore(history, workspace=ws)
    assert q.study is not None and p.study is not None
    done = [t for t in p.study.trials if t.state == TrialState.COMPLETE]
    restored = [t for t in q.study.trials if t.state == TrialState.COMPLETE]
    assert len(restored) == len(done) == len(state.history)
    assert sorted(t.value for t in restored) == sorted(t.value for t in done)  # type: ignore[type-var]
    assert sorted(map(str, (t.params for t in restored))) == sorted(map(str, (t.params for t in done)))
    assert q.best_value() == p.best_value() and q.objective == p.objective

    # Both continue in the same stage, and the restored one repeats nothing.
    resumed = LoopState(workspace=ws, run=state.run, best=state.best, history=list(state.history),
                        feedback=state.feedback, gates=state.gates)
    step = q.propose(resumed)
    assert step is not None and q.active == p.active and q.stale_trials() == p.stale_trials()
    tried = {tuple(sorted(e.knobs.items())) for e in state.history}
    for _ in range(15):
        config = {**resumed.best.knobs, **step.change.knobs}
        assert tuple(sorted(config.items())) not in tried
        tried.add(tuple(sorted(config.items())))
        exp = run_step(resumed, step, 400.0)
        resumed.history.append(exp)
        q.observe(resumed, exp)
        step = q.propose(resumed)
        assert step is not None


def test_restore_without_a_workspace_takes_the_trials_at_the_next_proposal(ws: Workspace) -> None:
    p = SearchProposer(seed=5)
    _, _, state = simulate(ws, p, 6, [QUEUE], objective=lambda c: 500.0)
    q = SearchProposer(seed=5)
    q.restore(list(state.history))
    assert q.study is None
    step = q.propose(state)
    assert step is not None and q.study is not None
    assert sum(t.state == TrialState.COMPLETE for t in q.study.trials) == len(state.history)
    assert {**state.best.knobs, **step.change.knobs} not in [e.knobs for e in state.history]


def test_a_dropped_proposal_is_failed_and_not_repeated(ws: Workspace) -> None:
    p = SearchProposer(seed=0)
    state = make_state(ws, [QUEUE])
    first = p.propose(state)
    second = p.propose(state)  # the first was never run
    assert first is not None and second is not None and first.change.knobs != second.change.knobs
    assert p.study is not None
    failed = [t for t in p.study.trials if t.state == TrialState.FAIL and not t.user_attrs.get("repeat")]
    assert len(failed) == 1


def test_the_objective_moves_on_when_its_gate_passes(ws: Workspace) -> None:
    p = SearchProposer(seed=0)
    state = make_state(ws, [QUEUE])
    step = p.propose(state)
    assert step is not None
    exp = run_step(state, step, 800.0).model_copy(update={"feedback": feedback(800.0, [20.0] * 10)})
    state.history.append(exp)
    p.observe(state, exp)
    latency = GateResult(name="t", gate=f"p99_ttft_ms<=1.1 @{SCENARIO}", kind="relative", outcome="fail")
    # The throughput gate still fails: the objective stays.
    state.gates = [state.gates[0], latency]
    p.propose(state)
    assert p.objective == Objective("output_throughput", "higher", SCENARIO)
    # It passes: the next failing gate becomes the objective, and the study is rebuilt with its values.
    state.gates = [state.gates[0].model_copy(update={"outcome": "pass"}), latency]
    step = p.propose(state)
    assert step is not None and p.objective == Objective("p99_ttft_ms", "lower", SCENARIO)
    assert p.study is not None and p.study.direction.name == "MINIMIZE"
    values = [t.value for t in p.study.trials if t.state == TrialState.COMPLETE]
    assert values == [pytest.approx(20.0)]  # only the experiment with ttft samples has a p99


def test_options_are_checked() -> None:
    with pytest.raises(ValueError):
        SearchProposer(widen_after=0)
    with pytest.raises(ValueError):
        SearchProposer(min_effect=-1)


def test_stops_when_every_configuration_is_tried(tmp_path: Path) -> None:
    (tmp_path / "infra-agent.yaml").write_text(
        "target: {kind: endpoint, url: 'http://127.0.0.1:9'}\n"
        "knobs:\n"
        "  fast: {type: bool, default: false, components: [engine]}\n"
        "  name: {type: str, default: x}\n"
        "  delay: {type: float, min: 0, max: 10, default: 0, components: [engine], help: 'Calibration only; sleeps.'}\n"
        "scenarios:\n"
        "  s: {dataset: {kind: random, input_len: 8, output_len: 8}, num_requests: 4}\n")
    small = load_workspace(tmp_path)
    p = SearchProposer(seed=0)
    base = Experiment(id="e0", run_id="r1", seq=0, role="baseline", status="done", knobs=small.resolve_knobs(),
                      hypothesis=Hypothesis(statement="baseline", metric="output_throughput", direction="higher",
                                            min_effect=0.0, scenario=None))
    state = LoopState(workspace=small, run=RunRecord(id="r1", workspace=str(tmp_path), proposer="search", started_at=0.0),
                      best=base, history=[base])
    step = p.propose(state)
    assert p.searchable == ("fast",)  # str and calibration knobs are not searched
    assert p.objective == Objective("output_throughput", "higher", "s")  # no criteria: throughput
    assert step is not None and step.change.knobs == {"fast": True}
    exp = run_step(state, step, None, status="error")
    state.history.append(exp)
    p.observe(state, exp)
    # A confirmation run of the best is no trial.
    confirm = exp.model_copy(update={"id": "e2", "role": "confirm", "status": "done", "change": Change(diff=None)})
    p.observe(state, confirm)
    assert p.study is not None and len(p.study.trials) == 2
    assert p.propose(state) is None
    assert p.stopped_reason is not None and "no untried configuration" in p.stopped_reason


def test_a_knob_a_finding_names_is_tried_alone_before_the_top_k_space(tmp_path: Path) -> None:
    ws, named = _lm_head_named_at_the_scheduler(tmp_path)
    p = SearchProposer(seed=3, widen_after=100)  # the default top_k, 2
    _, steps, _ = simulate(ws, p, 5, [named], objective=lambda c: 500.0)
    assert p.stages[0] == ("lm_head_precision",) and len(p.stages[1]) == 2 and p.stages[1][0] == "lm_head_precision"
    assert [set(s.change.knobs) for s in steps[:3]] == [{"lm_head_precision"}] * 3
    # The next stage adds a knob, moved alone from the best first (a local move), then TPE.
    assert steps[3].change.knobs == {p.stages[1][1]: 64} and set(steps[4].change.knobs) <= set(p.stages[1])
    assert p.widenings[0].endswith("every configuration of lm_head_precision tried")
    # Without a named knob the first stage is the top two, as before.
    q = SearchProposer(seed=3)
    simulate(ws, q, 1, [QUEUE], objective=lambda c: 500.0)
    assert len(q.stages[0]) == 2


def test_a_new_best_whose_findings_name_another_knob_restarts_the_space_there(ws: Workspace) -> None:
    p = SearchProposer(seed=4)
    state = make_state(ws, [QUEUE])
    first = p.propose(state)
    assert first is not None and set(p.stages[0]) == {"max_running", "max_batch_tokens"}
    assert first.change.knobs == {"max_running": 64}  # a local move of the top knob (was a joint draw of the stage)
    exp = run_step(state, first, 2000.0)
    state.history.append(exp)
    p.observe(state, exp)
    # Accepted; the new best's check names a knob the baseline's findings did not point at.
    state.best = exp
    state.feedback = [Feedback(probe="serving", tier=Tier.e2e, findings=[Finding(
        kind="step_overhead", severity="warning", message="m", location=Location(component="runtime", knob="torch_threads"))])]
    second = p.propose(state)
    assert second is not None and set(second.change.knobs) == {"torch_threads"}
    assert p.stages[0] == ("torch_threads",) and p.widenings[-1] == f"re-ranked on {exp.id}'s findings: torch_threads first"
    # The same findings on the same best do not restart it again.
    stages = list(p.stages)
    exp2 = run_step(state, second, 2000.0)
    state.history.append(exp2)
    p.observe(state, exp2)
    p.propose(state)
    assert p.stages == stages


def test_a_knob_a_check_compares_is_never_searched() -> None:
    ws = load_workspace(Path(__file__).resolve().parents[3] / "examples" / "kv-transfer")
    p = SearchProposer(seed=0, blind=True)
    p._bind(ws)
    assert "kv_transfer" in ws.knobs and "kv_transfer" not in p.searchable  # the check's compare_knob
    assert "kv_page_tokens" in p.searchable and "ep_release_gil" in p.searchable
