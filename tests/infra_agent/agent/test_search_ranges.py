"""The search proposer inside the space a workspace declares: typical ranges first, machine
bounds, constraints, aliases and identical launches, and local moves before TPE.

No servers: the loop is simulated with a synthetic objective (as in test_search.py), on
small workspaces written here; the machine is this one (os.sched_getaffinity).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.search import SearchProposer
from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier
from infra_agent.records import (
    Experiment,
    GateResult,
    Hypothesis,
    RunRecord,
    Step,
)
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Workspace

CORES = len(os.sched_getaffinity(0))
SCENARIO = "chat"
GATE = f"output_throughput>=1e+06 @{SCENARIO}"

WORKSPACE = """\
target:
  kind: server
  command: serve --port {port} --threads {threads} --seqs {seqs} --budget {budget} --kv {kv} --chunk {chunk}
knobs:
  threads: {type: int, min: 0, max: 1024, default: 1, resource: threads, components: [runtime]}
  seqs: {type: int, min: 1, max: 4096, default: 64, typical: [16, 1024], components: [engine.scheduler]}
  budget: {type: int, min: 16, max: 1048576, default: 8192, typical: [1024, 32768], components: [engine.scheduler]}
  kv: {type: choice, choices: [auto, bfloat16, fp8], default: auto, aliases: {auto: bfloat16}, components: [engine.cache]}
  chunk: {type: int, min: 1, max: 65536, default: 256, components: [model]}
constraints: ["budget >= seqs * 4"]
scenarios:
  chat: {dataset: {kind: random, input_len: 8, output_len: 8}, num_requests: 4}
criteria:
  - {name: tput, metric: output_throughput, scenario: chat, op: ">=", value: 1000000}
"""


def finding(component: str, knob: str | None = None) -> Finding:
    return Finding(kind="queue_dominates_ttft", severity="warning", message="m",
                   location=Location(component=component, knob=knob), evidence={"scenario": SCENARIO})


def workspace(tmp_path: Path, text: str = WORKSPACE) -> Workspace:
    (tmp_path / "infra-agent.yaml").write_text(text)
    return load_workspace(tmp_path)


def fb(value: float | None, samples: list[float] | None = None) -> Feedback:
    if value is None:
        return Feedback(probe="serving", tier=Tier.e2e, ok=False, error="server exited")
    return Feedback(probe="serving", tier=Tier.e2e, measurements=[
        Measurement.from_samples("output_throughput", "tok/s", samples or [value], better="higher", component="client",
                                 scenario=SCENARIO)])


def state_of(ws: Workspace, findings: list[Finding]) -> LoopState:
    base = Experiment(id="e0", run_id="r1", seq=0, role="baseline", proposer="baseline", status="done",
                      knobs=ws.resolve_knobs(), feedback=fb(100.0),
                      hypothesis=Hypothesis(statement="baseline", metric="output_throughput", direction="higher"))
    gates = [GateResult(name="tput", gate=GATE, kind="absolute", outcome="fail")]
    return LoopState(workspace=ws, run=RunRecord(id="r1", workspace=str(ws.root), proposer="search", started_at=0.0),
                     best=base, history=[base], gates=gates, feedback=[Feedback(probe="serving", tier=Tier.e2e, findings=findings)])


def run(ws: Workspace, proposer: SearchProposer, n: int, findings: list[Finding],
        objective: Any = lambda c: 100.0, accept: float = 1.05) -> tuple[list[Step], LoopState]:
    """propose/observe ``n`` times; an experiment ``accept`` x better than the best becomes the best."""
    state = state_of(ws, findings)
    best = objective(state.best.knobs)
    steps = []
    for _ in range(n):
        step = proposer.propose(state)
        if step is None:
            break
        steps.append(step)
        config = {**state.best.knobs, **step.change.knobs}
        value = objective(config)
        seq = len(state.history)
        exp = Experiment(id=f"e{seq}", run_id="r1", seq=seq, parent=state.best.id, proposer="search", status="done",
                         hypothesis=step.hypothesis, change=step.change, knobs=config, feedback=fb(value))
        state.history.append(exp)
        proposer.observe(state, exp)
        if value >= best * accept:
            state.best, best = exp, value
    return steps, state


def configs(state: LoopState) -> list[dict[str, Any]]:
    return [e.knobs for e in state.history[1:]]


@pytest.mark.parametrize("blind", [False, True])
def test_never_a_thread_count_above_the_cores(tmp_path: Path, blind: bool) -> None:
    ws = workspace(tmp_path)
    p = SearchProposer(seed=7, blind=blind)
    # The finding points at the threads knob: the search wants to try it, and may not go past the cores.
    steps, state = run(ws, p, 30, [finding("runtime", knob="threads")], objective=lambda c: 100.0 + c["threads"])
    assert len(steps) == 30
    threads = [c["threads"] for c in configs(state)]
    assert max(threads) <= CORES, threads
    assert len(set(threads)) > 1 or CORES == 1  # it did search the knob
    r = p.search_range("threads")
    assert r is not None and r.hi == CORES and r.bound is not None and "sched_getaffinity" in r.bound.source


def test_the_machine_can_be_overridden(tmp_path: Path) -> None:
    ws = workspace(tmp_path, WORKSPACE + "machine: {cores: 8}\n")
    p = SearchProposer(seed=1)
    _, state = run(ws, p, 12, [finding("runtime", knob="threads")], objective=lambda c: 100.0 + c["threads"])
    assert max(c["threads"] for c in configs(state)) <= 8
    assert p.search_range("threads").hi == 8  # type: ignore[union-attr]


def test_the_typical_range_is_sampled_first(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    for seed in range(3):
        p = SearchProposer(seed=seed)
        # Nothing improves and the best (the default 64) is no edge: the range never widens.
        _, state = run(ws, p, 20, [finding("engine.scheduler")])
        for c in configs(state):
            assert 16 <= c["seqs"] <= 1024 and 1024 <= c["budget"] <= 32768, c
        assert not any(w.startswith("widened") for w in p.widenings)
    # A blind search is plain Optuna over the domains (within the machine): it leaves them at once.
    p = SearchProposer(seed=0, blind=True)
    _, state = run(ws, p, 20, [finding("engine.scheduler")])
    assert any(not 16 <= c["seqs"] <= 1024 or not 1024 <= c["budget"] <= 32768 for c in configs(state))


def test_the_range_widens_when_the_best_sits_at_its_edge(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    p = SearchProposer(seed=0)
    # More sequences always pay (while the budget holds them): the best climbs to 1024, the
    # typical range's upper edge, and only then does the search look past it.
    _, state = run(ws, p, 14, [finding("engine.scheduler", knob="seqs")], objective=lambda c: float(c["seqs"]))
    seqs = [c["seqs"] for c in configs(state)]
    edge = seqs.index(1024)
    assert all(s <= 1024 for s in seqs[:edge + 1])
    widened = [w for w in p.widenings if w.startswith("widened seqs [16, 1024] -> [16, 4096]")]
    assert widened and "the best value 1024 sits at its upper edge" in widened[0] and "attribution ranks it" in widened[0]
    assert max(seqs) > 1024
    assert all(c["budget"] >= c["seqs"] * 4 for c in configs(state))  # the constraint holds out there too


def test_local_moves_come_before_tpe(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    p = SearchProposer(seed=0)
    steps, _ = run(ws, p, 4, [finding("engine.scheduler")])
    assert set(p.active) == {"seqs", "budget"}  # equal scores: by name
    # From the best (seqs 64, budget 8192): each ranked knob x2, one knob a step; both miss, so TPE.
    assert [s.change.knobs for s in steps[:2]] == [{"budget": 16384}, {"seqs": 128}]
    assert all(s.change.description.startswith("search local move: ") for s in steps[:2])
    assert "local move" in steps[0].rationale and "TPE trial" in steps[2].rationale
    assert set(steps[2].change.knobs) == {"seqs", "budget"}


def test_local_moves_go_on_while_they_pay(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    p = SearchProposer(seed=0)
    # Fewer sequences pay: x2 misses, /2 becomes the best, and the moves go on from each new best;
    # at the typical range's lower edge (16) the ranked knob's range grows, /4 at a time.
    steps, state = run(ws, p, 6, [finding("engine.scheduler", knob="seqs")], objective=lambda c: 1e4 / c["seqs"])
    assert p.stages[0] == ("seqs",)
    assert [s.change.knobs["seqs"] for s in steps] == [128, 32, 16, 8, 4, 2]
    assert all(s.change.description.startswith("search local move: ") for s in steps)
    assert [w.split(":")[0] for w in p.widenings] == ["widened seqs [16, 1024] -> [4, 1024]", "widened seqs [4, 1024] -> [1, 1024]"]
    assert state.best.knobs["seqs"] == 2


def test_local_moves_stop_after_two_misses(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    p = SearchProposer(seed=0)
    # The default (64) is the peak: x2 (128) misses, /2 (32) misses, so TPE samples next.
    steps, _ = run(ws, p, 3, [finding("engine.scheduler", knob="seqs")], objective=lambda c: 200.0 - abs(c["seqs"] - 64))
    assert [s.change.knobs for s in steps[:2]] == [{"seqs": 128}, {"seqs": 32}]
    assert "TPE trial" in steps[2].rationale and not steps[2].change.description.startswith("search local move")


def test_constraints_are_never_broken(tmp_path: Path) -> None:
    # A tight constraint over overlapping ranges: most joint draws break it.
    text = WORKSPACE.replace('constraints: ["budget >= seqs * 4"]', 'constraints: ["budget >= seqs * 16"]') \
        .replace("typical: [1024, 32768]", "typical: [1024, 8192]")
    ws = workspace(tmp_path, text)
    for blind in (False, True):
        p = SearchProposer(seed=2, blind=blind)
        _, state = run(ws, p, 25, [finding("engine.scheduler")])
        assert len(configs(state)) == 25
        assert all(c["budget"] >= c["seqs"] * 16 for c in configs(state)), configs(state)


def test_an_alias_of_the_best_value_is_never_proposed(tmp_path: Path) -> None:
    ws = workspace(tmp_path)
    p = SearchProposer(seed=0)
    steps, state = run(ws, p, 3, [finding("engine.cache", knob="kv")])
    assert p.stages[0] == ("kv",)
    # auto launches as bfloat16: the one knob's only real change is fp8, then the stage is spent.
    assert steps[0].change.knobs == {"kv": "fp8"}
    assert all(c["kv"] != "bfloat16" for c in configs(state))
    assert p.widenings[0].endswith("every configuration of kv tried")


def test_a_change_the_launch_does_not_see_is_never_proposed(tmp_path: Path) -> None:
    # ``chunk`` is declared but no placeholder uses it: moving it launches the same server.
    ws = workspace(tmp_path, WORKSPACE.replace(" --chunk {chunk}", ""))
    p = SearchProposer(seed=0)
    _, state = run(ws, p, 12, [finding("model", knob="chunk")])
    assert all(c["chunk"] == 256 for c in configs(state))
    assert p.widenings and "chunk" in p.stages[0]
