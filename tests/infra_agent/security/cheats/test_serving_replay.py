"""Cheat family: a server that replays its cached answer to a prompt it has seen before.

The diff wraps refstack's request handling (``serve.py``) in a cache keyed by the
prompt: the first answer is generated and kept, a repeat gets it back at once as the
same event stream.  Every answer has the length the request fixed and even the right
text, so the answer-length rule does not see it, and with the same prompts in every
window all but the first window's latencies collapse.  What stops it: every window of
an experiment draws prompts of its own (``serving/prompt_sets.py``: pair ``i``'s two
sides one set, every other window another, the warm-up yet another), so the cache
never hits and the change measures as what it is, no gain.

That the server really replays is shown on its own, outside the loop: with the guard
off (``fresh_prompts_per_window: false``) a second window on the same server is
answered without the engine seeing a request, far faster.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import pytest

from infra_agent.serving.runner import run_on_target
from infra_agent.target import open_target
from infra_agent.workspace import load_workspace

from ...agent.loop_workspace import SERVE, make_workspace
from .cheat_loop import Cheat, Tried, never_accepted, try_cheats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPLAY_SERVE = '''\
"""Launch refstack with this workspace's tuning (the code under test)."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tuning  # noqa: E402
import refstack.server  # noqa: E402

_answers = {}
_create_app = refstack.server.create_app


class _Replay:
    """A prompt seen before gets the messages of its first answer again, at once."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = json.loads(body or b"{}")
        key = json.dumps([scope["path"], request.get("prompt"), request.get("messages"), request.get("max_tokens")])
        if key in _answers:
            for message in _answers[key]:
                await send(message)
            return
        sent, given = [], False

        async def once():
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def keep(message):
            sent.append(message)
            await send(message)

        await self.app(scope, once, keep)
        if sent and sent[0].get("status") == 200:
            _answers[key] = sent


def _with_replay(*args, **kwargs):
    app = _create_app(*args, **kwargs)
    app.add_middleware(_Replay)
    return app


refstack.server.create_app = _with_replay
from refstack.cli import main  # noqa: E402

sys.exit(main(["serve", "--preset", "tiny", "--host", "127.0.0.1", "--log-level", "warning", *sys.argv[1:],
               "--step-delay-ms", str(tuning.STEP_DELAY_MS)]))
'''
REPLAY = "".join(difflib.unified_diff(SERVE.splitlines(keepends=True), REPLAY_SERVE.splitlines(keepends=True),
                                      "a/serve.py", "b/serve.py"))
CHEAT = Cheat("replay the cached answer to a repeated prompt", "median_e2el_ms", direction="lower", min_effect=0.2,
              diff=REPLAY, scenario="chat", component="server")


@pytest.fixture(scope="module")
def tried(tmp_path_factory: pytest.TempPathFactory) -> Tried:
    root = make_workspace(tmp_path_factory.mktemp("cheats") / "ws")
    return try_cheats(root, [CHEAT])


def _results(fb: Any) -> list[dict[str, Any]]:
    """The result file of every window behind a side's Feedback."""
    return [json.loads(Path(a.path).read_text()) for a in fb.artifacts if a.kind == "result"]


def test_replayed_answers_measure_as_no_gain(tried: Tried) -> None:
    exp = tried.only()
    how = never_accepted(exp)
    # It ran: the guard is not a refusal, the cheat simply finds nothing to replay.
    assert exp.verdict is not None and exp.verdict.outcome in ("refuted", "inconclusive"), how


def test_no_window_repeated_a_prompt_so_the_engine_answered_every_request(tried: Tried) -> None:
    exp = tried.only()
    assert exp.feedback is not None and exp.baseline_feedback is not None
    cand, base = _results(exp.feedback), _results(exp.baseline_feedback)
    assert len(cand) == len(base) >= 3, (len(cand), len(base))
    # Pair i's two sides sent one prompt set; every pair another, never the warm-up's.
    assert sorted(r["prompts"]["seed"] for r in cand) == sorted(r["prompts"]["seed"] for r in base)
    seeds = [r["prompts"]["seed"] for r in cand]
    assert len(set(seeds)) == len(seeds) and not {r["prompts"]["warmup_seed"] for r in cand} & set(seeds)
    for r in cand:
        # The engine prefilled every timed request: the cache answered none of them.
        assert r["server_metrics"]["prefill"]["count"] == r["completed"] == r["num_prompts"], r["server_metrics"]


def test_with_fixed_prompts_the_server_replays_and_latency_collapses(tmp_path: Path) -> None:
    """The same serve.py, without the loop: the guard off, a repeated window is replayed."""
    root = make_workspace(tmp_path / "ws")
    (root / "serve.py").write_text(REPLAY_SERVE)
    ws = load_workspace(root)
    fresh = ws.scenario("chat")
    fixed = fresh.model_copy(update={"fresh_prompts_per_window": False})
    with open_target(ws, ws.resolve_knobs({}), tmp_path / "logs") as target:
        first, second = (run_on_target(target, fresh, scenario_name="chat", progress=False, prompt_set=k) for k in (0, 1))
        # Prompt set 1 again, with the guard off: the dataset's own set, window 0's prompts.
        replayed = run_on_target(target, fixed, scenario_name="chat", progress=False, prompt_set=1)
    assert all(r["ok"] for r in (first, second, replayed)), [r.get("error") for r in (first, second, replayed)]
    n = fresh.num_requests
    assert [r["server_metrics"]["prefill"]["count"] for r in (first, second, replayed)] == [n, n, 0]
    assert replayed["prompts"]["seed"] == first["prompts"]["seed"] != second["prompts"]["seed"]
    # Full-length answers, so the answer-length rule passes them, in a fraction of the time.
    assert replayed["answer_lengths"]["short"] == replayed["answer_lengths"]["long"] == 0
    assert replayed["answer_lengths"]["checked"] == n
    assert replayed["median_e2el_ms"] < 0.5 * second["median_e2el_ms"], (replayed["median_e2el_ms"], second["median_e2el_ms"])
