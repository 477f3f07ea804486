"""The greedy-text rule: the same answers, a near tie forgiven, anything else refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra_agent.feedback import Feedback, Tier
from infra_agent.judge.greedy_text import (
    TIE_NATS,
    claims_same_outputs,
    compare_answers,
    text_change,
)
from infra_agent.records import Change
from infra_agent.workspace import load_workspace

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def answer(tokens: list[str], gaps: list[float | None], seconds: list[str | None] | None = None) -> dict:
    seconds = seconds or [None] * len(tokens)
    return {"text": "".join(tokens), "tokens": [{"token": t, "gap": g, "second": s}
                                               for t, g, s in zip(tokens, gaps, seconds, strict=True)]}


def record(*answers: dict, max_tokens: int = 3) -> dict:
    return {"answers": list(answers), "max_tokens": max_tokens}


def test_the_same_answers_agree() -> None:
    a = answer(["a", "b", "c"], [1.0, 2.0, 0.5])
    got = compare_answers(record(a, a), record(a, a))
    assert got.compared == 2 and not got.changed and got.near_ties == 0
    assert "the same greedy text on 2" in got.text()


def test_a_near_tie_is_forgiven_and_nothing_after_it_is_compared() -> None:
    parent = answer(["a", "b", "c"], [1.0, TIE_NATS / 4, 2.0], [None, "x", None])
    # The candidate took the parent's second choice where the two were within a near tie;
    # everything after it differs, as it would after any different token.
    cand = answer(["a", "x", "q"], [1.0, 0.01, 3.0])
    got = compare_answers(record(parent), record(cand))
    assert not got.changed and got.near_ties == 1


def test_a_difference_beyond_a_tie_is_a_changed_answer() -> None:
    parent = answer(["a", "b", "c"], [1.0, 2.5, 2.0], [None, "x", None])
    cand = answer(["a", "x", "c"], [1.0, 2.5, 2.0])
    got = compare_answers(record(parent, parent), record(parent, cand))
    assert got.changed == [{"prompt": 1, "at": 1, "parent": "b", "candidate": "x", "gap": 2.5}]
    assert "differs from the parent's on 1 of 2" in got.text() and "token 1 is 'x', not 'b'" in got.text()
    # Not the parent's second choice: changed even at a small gap.
    odd = answer(["a", "z", "c"], [1.0, 2.5, 2.0])
    assert compare_answers(record(answer(["a", "b", "c"], [1.0, 0.01, 1.0], [None, "x", None])),
                           record(odd)).changed
    # Without logprobs nothing can be called a tie.
    bare = answer(["a", "b", "c"], [None, None, None])
    assert compare_answers(record(bare), record(answer(["a", "x", "c"], [None, None, None]))).changed
    # A shorter answer (an early stop) differs at its end.
    assert compare_answers(record(parent), record(answer(["a", "b"], [1.0, 2.5]))).changed[0]["at"] == 2


def test_an_unanswered_probe_set_leaves_the_comparison_unmade() -> None:
    a = answer(["a"], [1.0])
    got = compare_answers({"unavailable": "POST /v1/completions answered HTTP 404"}, record(a, max_tokens=1))
    assert got.unmade and "parent's server" in got.text() and not got.changed
    assert compare_answers(record(a, max_tokens=1), record(a, a, max_tokens=1)).unmade


def test_a_knob_declared_to_change_outputs_is_not_held_to_the_text() -> None:
    ws = load_workspace(EXAMPLES / "quantization")
    assert ws.knobs["quantization"].changes_outputs
    assert not claims_same_outputs(ws, Change(knobs={"quantization": "w8a8"}))
    assert claims_same_outputs(ws, Change(knobs={"max_running": 8})) if "max_running" in ws.knobs else True
    assert claims_same_outputs(ws, Change(diff="--- a/x\n+++ b/x\n"))
    parent = record(answer(["a", "b", "c"], [1.0, 2.5, 2.0]))
    cand = record(answer(["q", "r", "s"], [1.0, 2.5, 2.0]))
    side = {"chat": [Feedback(probe="serving", tier=Tier.e2e, meta={"greedy": cand})]}
    base = {"chat": [Feedback(probe="serving", tier=Tier.e2e, meta={"greedy": parent})]}
    assert text_change(ws, Change(knobs={"quantization": "w8a8"}), side, base) is None
    got = text_change(ws, Change(diff="x"), side, base)
    assert got is not None and len(got.changed) == 1
    # Neither side carries a probe set (a check run, a timeline window): nothing to compare.
    assert text_change(ws, Change(diff="x"), {"chat": [Feedback(probe="serving", tier=Tier.e2e)]}, base) is None


@pytest.mark.parametrize("name", ["quantization", "refstack-serving", "tp-numerics-e2e", "vllm-serving", "sglang-serving"])
def test_the_examples_declare_their_output_changing_knobs(name: str) -> None:
    ws = load_workspace(EXAMPLES / name)
    for knob in ("quantization", "kv_cache_dtype", "dtype", "lm_head_precision", "kv_cache_dtype_layers"):
        if knob in ws.knobs:
            assert ws.knobs[knob].changes_outputs, (name, knob)
