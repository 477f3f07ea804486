"""set_knobs, run_experiment, read_ledger, finish."""

from __future__ import annotations

import json

import pytest

from infra_agent.feedback import Tier
from infra_agent.records import (
    Change,
    Cost,
    Experiment,
    Hypothesis,
    Step,
    Verdict,
)
from infra_agent.tools import ToolContext, ToolRegistry

HYP = {"statement": "more requests at once cut queueing", "metric": "output_throughput", "direction": "higher",
       "min_effect": 0.05, "scenario": "chat", "locality": {"component": "engine.scheduler", "knob": "max_running"}}


def call(registry: ToolRegistry, ctx: ToolContext, name: str, **args: object):
    return registry.call(name, json.dumps(args), ctx)


def test_set_knobs_checks_domains_and_merges(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "set_knobs", knobs={"max_running": "32"})
    assert not r.error and ctx.pending.knobs == {"max_running": 32}
    r = call(registry, ctx, "set_knobs", knobs={"precision": "bf16"})
    assert ctx.pending.knobs == {"max_running": 32, "precision": "bf16"}
    assert "pending knobs: max_running=32, precision='bf16'" in r.text
    r = call(registry, ctx, "set_knobs", knobs={"precision": None})
    assert ctx.pending.knobs == {"max_running": 32}
    same = call(registry, ctx, "set_knobs", knobs={"precision": "fp32"})
    assert "equal to the current best already: precision" in same.text
    assert call(registry, ctx, "set_knobs", knobs={}).text == "pending knobs cleared" and ctx.pending.knobs == {}


def test_set_knobs_errors_name_knob_and_domain_and_change_nothing(registry: ToolRegistry, ctx: ToolContext) -> None:
    call(registry, ctx, "set_knobs", knobs={"max_running": 8})
    r = call(registry, ctx, "set_knobs", knobs={"max_running": 9999, "precision": "fp8", "threads": 4})
    assert r.error and r.text.startswith("set_knobs: nothing changed")
    assert "knob 'max_running': expected int in [1, 256] (its domain), got 9999" in r.text
    assert "knob 'precision': expected one of 'fp32', 'bf16' (its domain), got 'fp8'" in r.text
    assert "knob 'threads': not declared in the workspace (the knobs are: max_running, precision)" in r.text
    assert ctx.pending.knobs == {"max_running": 8}
    nested = call(registry, ctx, "set_knobs", knobs={"max_running": [1, 2]})
    assert nested.error and "knobs.max_running" in nested.text


def test_run_experiment_submits_one_step(registry: ToolRegistry, ctx: ToolContext) -> None:
    call(registry, ctx, "set_knobs", knobs={"max_running": 64})
    r = call(registry, ctx, "run_experiment", rationale="queue share 0.8", **HYP)
    assert not r.error, r.text
    (step,) = ctx.submitted  # type: ignore[attr-defined]
    assert isinstance(step, Step)
    assert step.hypothesis == Hypothesis.model_validate(HYP)
    assert step.change.knobs == {"max_running": 64} and step.rationale == "queue share 0.8"
    assert step.change.description == HYP["statement"]
    assert ctx.pending.empty
    assert "output_throughput>=1.05" in r.text


def test_run_experiment_needs_a_change_and_a_hypothesis(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "run_experiment", **HYP)
    assert r.error and "the pending change is empty" in r.text
    call(registry, ctx, "set_knobs", knobs={"max_running": 64})
    missing = {k: v for k, v in HYP.items() if k != "statement"}
    r = call(registry, ctx, "run_experiment", **missing)
    assert r.error and "field 'statement': expected a value (it is required), got nothing" in r.text
    r = call(registry, ctx, "run_experiment", **{**HYP, "direction": "up"})
    assert r.error and "field 'direction': expected 'higher' or 'lower', got 'up'" in r.text
    r = call(registry, ctx, "run_experiment", **{**HYP, "scenario": "batch"})
    assert r.error and "expected one of the workspace scenarios ['chat'], got 'batch'" in r.text
    r = call(registry, ctx, "run_experiment", **{**HYP, "locality": {"component": "gpu"}})
    assert r.error and "field 'locality.component'" in r.text and "'gpu'" in r.text
    assert ctx.submitted == []  # type: ignore[attr-defined]
    assert ctx.pending.knobs == {"max_running": 64}  # kept for the next try


def test_run_experiment_refuses_a_change_already_tried(registry: ToolRegistry, ctx: ToolContext) -> None:
    assert ctx.state is not None
    tried = Experiment(id="e1", run_id="run1", seq=1, parent="e0", hypothesis=Hypothesis.model_validate(HYP),
                       change=Change(knobs={"max_running": 64}, diff=None), status="done",
                       verdict=Verdict(outcome="refuted", effect=0.99, low=0.97, high=1.01))
    ctx.state.history.append(tried)
    call(registry, ctx, "set_knobs", knobs={"max_running": 64})
    r = call(registry, ctx, "run_experiment", **HYP)
    assert r.error and "already tried in experiment e1 (refuted effect 0.99 [0.97, 1.01])" in r.text


def _tried(exp_id: str, parent: str, verdict: Verdict) -> Experiment:
    return Experiment(id=exp_id, run_id="run1", seq=int(exp_id[1:]), parent=parent, status="done",
                      hypothesis=Hypothesis.model_validate(HYP), change=Change(knobs={"max_running": 64}, diff=None),
                      verdict=verdict)


def test_the_same_change_as_an_open_experiment_is_its_top_up(registry: ToolRegistry, ctx: ToolContext) -> None:
    # Inconclusive is not refuted: the same change tried earlier on the best and refuted comes first in
    # the history, but the open one (its estimate on the predicted side) on the best is topped up.
    assert ctx.state is not None and ctx.state.best.id == "e0"
    ctx.state.history += [_tried("e1", "e9", Verdict(outcome="refuted", effect=0.9, low=0.85, high=0.95)),
                          _tried("e2", "e0", Verdict(outcome="inconclusive", effect=1.04, low=0.98, high=1.1))]
    call(registry, ctx, "set_knobs", knobs={"max_running": 64})
    r = call(registry, ctx, "run_experiment", **HYP)
    assert not r.error and r.data["top_up_of"] == "e2", r.text
    assert r.text.startswith("as one more batch of the open experiment e2")
    assert [s.change.knobs for s in ctx.submitted] == [{"max_running": 64}]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("parent", "verdict", "refused"), [
    ("e9", Verdict(outcome="refuted", effect=0.9, low=0.85, high=0.95), False),  # an earlier parent: runs again
    ("e9", Verdict(outcome="supported", effect=1.2, low=1.1, high=1.3, accepted=True), True),  # in the best already
    ("e0", Verdict(outcome="inconclusive", effect=0.97, low=0.9, high=1.04), True),  # undecided, not promising
])
def test_what_already_tried_refuses(registry: ToolRegistry, ctx: ToolContext, parent: str, verdict: Verdict,
                                    refused: bool) -> None:
    assert ctx.state is not None
    ctx.state.history.append(_tried("e1", parent, verdict))
    call(registry, ctx, "set_knobs", knobs={"max_running": 64})
    r = call(registry, ctx, "run_experiment", **HYP)
    assert r.error == refused and ("already tried in experiment e1" in r.text) == refused, r.text
    assert r.error or r.data["top_up_of"] is None


def test_run_experiment_without_a_loop(registry: ToolRegistry, ctx: ToolContext) -> None:
    ctx.submit_step = None
    call(registry, ctx, "set_knobs", knobs={"max_running": 64})
    assert "cannot be run from here" in call(registry, ctx, "run_experiment", **HYP).text


def test_read_ledger_summarises_experiments(registry: ToolRegistry, ctx: ToolContext) -> None:
    assert ctx.state is not None
    ctx.state.history.append(Experiment(
        id="e1", run_id="run1", seq=1, parent="e0", hypothesis=Hypothesis.model_validate(HYP), status="done",
        change=Change(knobs={"max_running": 64}, diff="--- a/src/engine.py\n+++ b/src/engine.py\n"),
        verdict=Verdict(outcome="supported", effect=1.12, low=1.05, high=1.2, accepted=True),
        cost=Cost(wall_s=12.5, tier=Tier.e2e, e2e_runs=2, llm_tokens=1234)))
    r = call(registry, ctx, "read_ledger", last_n=5)
    assert not r.error
    lines = r.text.splitlines()
    assert lines[0] == "2 experiments in run run1; current best: e0"
    assert lines[1].startswith("- e0 parent=- (baseline) | baseline")
    assert ("- e1 parent=e0 knobs max_running=64 diff src/engine.py | more requests at once cut queueing "
            "[output_throughput>=1.05] -> supported effect 1.12 [1.05, 1.2] accepted | 12.5 s, 2 e2e runs, 1234 LLM tokens") == lines[2]
    row = r.data["experiments"][1]
    assert row["verdict"]["outcome"] == "supported" and row["cost"]["llm_tokens"] == 1234
    assert row["change"] == {"knobs": {"max_running": 64}, "diff_paths": ["src/engine.py"]}
    assert len(call(registry, ctx, "read_ledger", last_n=1).data["experiments"]) == 1


def test_finish_records_the_reason(registry: ToolRegistry, ctx: ToolContext) -> None:
    r = call(registry, ctx, "finish", reason="all gates pass")
    assert not r.error and ctx.finished == "all gates pass"
    assert call(registry, ctx, "finish").error
