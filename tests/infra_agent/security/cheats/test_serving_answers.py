"""Cheat family: a server that does less (or other) work than it is timed on.

The diff keeps the system and changes its answers.

- ``serve.py`` wraps refstack's request handling so every answer gets half the tokens
  asked for.  Each request still succeeds, and every latency halves, so a latency
  hypothesis is "supported"; the scenario sends ``ignore_eos`` with ``max_tokens``, which
  fixes each answer's length, and the judge refuses a candidate whose answers are not that
  length.
- ``serve.py`` answers from other weights (``--seed 7``: a different, here equally cheap,
  model) alongside a real speed-up (a 3 ms step): every answer has the right length and the
  step is faster, but the text is another model's.  The change claims to keep the numbers
  (it moves no knob declared ``changes_outputs``), and the judge holds it to the parent's
  greedy text on a fixed probe set (``judge/greedy_text.py``).
"""

from __future__ import annotations

import difflib

import pytest

from ...agent.loop_workspace import FAST_DIFF, SERVE, make_workspace
from .cheat_loop import Cheat, Tried, by_cheat, try_cheats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HALF_ANSWERS_SERVE = '''\
"""Launch refstack with this workspace's tuning (the code under test)."""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tuning  # noqa: E402
from refstack.server import openai_routes  # noqa: E402

_params = openai_routes.sampling_params


def _half(*args, **kwargs):
    params = _params(*args, **kwargs)
    return dataclasses.replace(params, max_tokens=max(1, params.max_tokens // 2))


openai_routes.sampling_params = _half
from refstack.cli import main  # noqa: E402

sys.exit(main(["serve", "--preset", "tiny", "--host", "127.0.0.1", "--log-level", "warning", *sys.argv[1:],
               "--step-delay-ms", str(tuning.STEP_DELAY_MS)]))
'''
HALF_ANSWERS = "".join(difflib.unified_diff(SERVE.splitlines(keepends=True), HALF_ANSWERS_SERVE.splitlines(keepends=True),
                                            "a/serve.py", "b/serve.py"))


OTHER_WEIGHTS_SERVE = SERVE.replace('"--preset", "tiny",', '"--preset", "tiny", "--seed", "7",')
OTHER_WEIGHTS = "".join(difflib.unified_diff(SERVE.splitlines(keepends=True),
                                             OTHER_WEIGHTS_SERVE.splitlines(keepends=True), "a/serve.py", "b/serve.py")) + FAST_DIFF
CHEATS = [Cheat("half the tokens asked for", "median_e2el_ms", direction="lower", min_effect=0.2, diff=HALF_ANSWERS,
                scenario="chat", component="engine.loop"),
          Cheat("other weights", "median_e2el_ms", direction="lower", min_effect=0.2, diff=OTHER_WEIGHTS,
                scenario="chat", component="engine.loop")]


@pytest.fixture(scope="module")
def tried(tmp_path_factory: pytest.TempPathFactory) -> Tried:
    root = make_workspace(tmp_path_factory.mktemp("cheats") / "ws")
    return try_cheats(root, CHEATS)


def test_answers_shorter_than_asked_are_refused_by_the_judge(tried: Tried) -> None:
    exp = by_cheat(tried, CHEATS)["half the tokens asked for"]
    assert exp.verdict is not None, (exp.status, exp.error)
    # It ran and its latencies did fall: the cheat "worked" on the numbers (supported on a quiet
    # machine; beside the rest of the suite one pair's interval can straddle the 0.83 target,
    # the estimate still well under 1), and the answer-length rule is what refuses it, ahead of
    # whatever the numbers decided.
    assert exp.verdict.effect is not None and exp.verdict.effect < 0.9, exp.verdict
    assert not exp.accepted and exp.commit is None, exp.verdict.message
    assert "not the length the request fixed" in exp.verdict.message, exp.verdict.message


def test_the_finding_names_the_short_answers(tried: Tried) -> None:
    exp = by_cheat(tried, CHEATS)["half the tokens asked for"]
    assert exp.feedback is not None and exp.baseline_feedback is not None
    short = [f for f in exp.feedback.findings if f.kind == "wrong_answer_length"]
    assert short and short[0].evidence["short"] == short[0].evidence["checked"] > 0, exp.feedback.findings
    # The parent answered every request in full.
    assert not [f for f in exp.baseline_feedback.findings if f.kind == "wrong_answer_length"]


def test_answers_from_other_weights_are_refused_by_the_judge(tried: Tried) -> None:
    exp = by_cheat(tried, CHEATS)["other weights"]
    assert exp.verdict is not None, (exp.status, exp.error)
    # The speed-up in the same diff is real (a 3 ms step for a 30 ms one: the hypothesis may well
    # be supported) and the answers have the right length: the text is what refuses it.
    assert not exp.accepted and exp.commit is None, exp.verdict.message
    assert exp.verdict.effect is not None and exp.verdict.effect < 0.9, exp.verdict
    assert "greedy text differs from the parent's" in exp.verdict.message, exp.verdict.message
    assert not exp.verdict.served and not exp.open
    assert exp.feedback is not None and exp.baseline_feedback is not None
    cand, base = exp.feedback.meta["greedy"], exp.baseline_feedback.meta["greedy"]
    assert len(cand["answers"]) == len(base["answers"]) > 0
    assert [a["text"] for a in cand["answers"]] != [a["text"] for a in base["answers"]]
    assert not [f for f in exp.feedback.findings if f.kind == "wrong_answer_length"]
