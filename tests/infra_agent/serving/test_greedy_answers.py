"""A real refstack's greedy answers to the fixed probe set, as the judge compares them.

Two servers of one configuration answer the same (another max_running changes nothing a
single request at a time sees); another seed (other weights) answers other text, beyond any
near tie; a server without the completions route is recorded as unable to answer.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from infra_agent.judge.greedy_text import compare_answers
from infra_agent.serving.greedy_text import PROMPTS, answers_for, greedy_answers

pytestmark = pytest.mark.timeout(300)


def test_one_configuration_answers_the_same_and_other_weights_do_not(
        refstack_server_factory: Callable[..., SimpleNamespace]) -> None:
    a = refstack_server_factory(["--max-running", "4"])
    b = refstack_server_factory(["--max-running", "32"])
    other = refstack_server_factory(["--seed", "7"])
    base = greedy_answers(a.url, "refstack-tiny", max_tokens=8)
    assert len(base["answers"]) == len(PROMPTS)
    first = base["answers"][0]["tokens"]
    assert len(first) == 8 and all(t["gap"] is not None and t["gap"] >= 0 for t in first)
    same = compare_answers(base, greedy_answers(b.url, "refstack-tiny", max_tokens=8))
    assert same.compared == len(PROMPTS) and not same.changed, same.text()
    changed = compare_answers(base, greedy_answers(other.url, "refstack-tiny", max_tokens=8))
    assert len(changed.changed) >= len(PROMPTS) - 1, changed.text()
    assert "differs from the parent's" in changed.text()


def test_answers_are_asked_once_per_target(refstack_server_factory: Callable[..., SimpleNamespace]) -> None:
    server = refstack_server_factory()
    target = SimpleNamespace(url=server.url, model="refstack-tiny", request_headers={})
    got = answers_for(target, 4)
    assert answers_for(target, 4) is got  # kept on the target: a reused server is not asked again
    assert answers_for(target, 5) is not got  # another probe set is asked anew


def test_a_server_that_cannot_answer_is_recorded_as_such(refstack_server_factory: Callable[..., SimpleNamespace]) -> None:
    server = refstack_server_factory()
    got = greedy_answers(server.url + "/nowhere", "refstack-tiny")
    assert "HTTP 404" in got["unavailable"]
    assert "could not be sent" in greedy_answers("http://127.0.0.1:9", "m")["unavailable"]
