"""Cheat family: a server that does less work than it is timed on.

The diff keeps the system and changes its answers: ``serve.py`` wraps refstack's
request handling so every answer gets half the tokens asked for.  Each request still
succeeds, and every latency halves, so a latency hypothesis is "supported"; the
scenario sends ``ignore_eos`` with ``max_tokens``, which fixes each answer's length, and
the judge refuses a candidate whose answers are not that length.
"""

from __future__ import annotations

import difflib

import pytest

from ...agent.loop_workspace import SERVE, make_workspace
from .cheat_loop import Cheat, Tried, try_cheats

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


@pytest.fixture(scope="module")
def tried(tmp_path_factory: pytest.TempPathFactory) -> Tried:
    root = make_workspace(tmp_path_factory.mktemp("cheats") / "ws")
    return try_cheats(root, [Cheat("half the tokens asked for", "median_e2el_ms", direction="lower", min_effect=0.2,
                                   diff=HALF_ANSWERS, scenario="chat", component="engine.loop")])


def test_answers_shorter_than_asked_are_refused_by_the_judge(tried: Tried) -> None:
    exp = tried.only()
    assert exp.verdict is not None, (exp.status, exp.error)
    # It ran and its latencies did fall: the cheat "worked" on the numbers (supported on a quiet
    # machine; beside the rest of the suite one pair's interval can straddle the 0.83 target,
    # the estimate still well under 1), and the answer-length rule is what refuses it, ahead of
    # whatever the numbers decided.
    assert exp.verdict.effect is not None and exp.verdict.effect < 0.9, exp.verdict
    assert not exp.accepted and exp.commit is None, exp.verdict.message
    assert "not the length the request fixed" in exp.verdict.message, exp.verdict.message


def test_the_finding_names_the_short_answers(tried: Tried) -> None:
    exp = tried.only()
    assert exp.feedback is not None and exp.baseline_feedback is not None
    short = [f for f in exp.feedback.findings if f.kind == "wrong_answer_length"]
    assert short and short[0].evidence["short"] == short[0].evidence["checked"] > 0, exp.feedback.findings
    # The parent answered every request in full.
    assert not [f for f in exp.baseline_feedback.findings if f.kind == "wrong_answer_length"]
