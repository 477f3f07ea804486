"""The llm proposer against the stand-in chat server, over real HTTP on loopback."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from infra_agent.agent.proposers.base import LoopState, Proposer
from infra_agent.agent.proposers.llm import NUDGE, LLMProposer
from infra_agent.agent.proposers.llm_prompt import opening_message
from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Finding
from infra_agent.standin.server import received_requests, serve_standin

HYP = {"statement": "more requests at once cut queueing", "metric": "output_throughput", "direction": "higher",
       "min_effect": 0.05, "scenario": "chat", "locality": {"component": "engine.scheduler", "knob": "max_running"}}
RUN = {"tool": "run_experiment", "arguments": {**HYP, "rationale": "queue is 80% of TTFT"}}
SET = {"tool": "set_knobs", "arguments": {"knobs": {"max_running": 64}}}


def tool_messages(request: dict) -> dict[str, str]:
    return {m["tool_call_id"]: m["content"] for m in request["messages"] if m["role"] == "tool"}


def test_a_scripted_session(state: LoopState, make_proposer, make_experiment) -> None:
    script = [
        {"tool_calls": [{"tool": "read_file", "arguments": {"path": "src/engine.py"}},
                        {"tool": "search_code", "arguments": {"pattern": "max_running", "glob": "*.py"}}]},
        {"tool_calls": [SET]},
        {"tool_calls": [RUN]},
        {"tool_calls": [{"tool": "finish", "arguments": {"reason": "the gate passes now"}}]},
    ]
    with serve_standin(script) as url:
        p = make_proposer(url)
        assert isinstance(p, Proposer) and p.name == "llm"
        step = p.propose(state)
        assert step is not None
        assert step.hypothesis.statement == HYP["statement"] and step.hypothesis.min_effect == 0.05
        assert step.hypothesis.locality.knob == "max_running"
        assert step.change.knobs == {"max_running": 64} and step.rationale == "queue is 80% of TTFT"
        assert p.last_call_id == "call_2_0"
        reqs = received_requests(url)
        assert step.llm_tokens == p.tokens_used > 0 and p.turns == 3 == len(reqs)
        done = make_experiment(step.hypothesis, step.change.knobs)
        state.history.append(done)
        p.observe(state, done)
        assert p.propose(state) is None
        assert p.stopped_reason == "finished: the gate passes now"
        assert p.propose(state) is None  # stays stopped, asks nothing more
        reqs = received_requests(url)
    assert len(reqs) == 4
    system, opening = reqs[0]["messages"]
    assert system["role"] == "system" and "ONE hypothesis" in system["content"] and "no shell" in system["content"]
    text = opening["content"]
    assert "- max_running: int in [1, 256]; now 16; engine.scheduler; requests at once" in text
    assert "- chat: random input_len=32 output_len=8 requests=8" in text
    assert "- tput: output_throughput>=1.05 @chat -> FAIL value=1 [0.98, 1.02]" in text
    assert "queue_dominates_ttft" in text and "next: is max_running too low?" in text
    assert set(reqs[0]["tools"]) == {"read_file", "search_code", "propose_diff", "set_knobs", "run_experiment",
                                     "read_ledger", "finish"}
    results = tool_messages(reqs[1])
    assert "class Scheduler:" in results["call_0_0"] and "src/engine.py:2:" in results["call_0_1"]
    assert "pending knobs: max_running=64" in tool_messages(reqs[2])["call_1_0"]
    verdict = tool_messages(reqs[3])["call_2_0"]
    assert verdict.startswith("experiment e1 (done)")
    assert "verdict: SUPPORTED effect=1.12 [1.05, 1.2]" in verdict and "ACCEPTED" in verdict
    # The candidate's side under its own header; its metrics in the side-by-side table (no baseline here).
    assert "\ncandidate (e1) [e2e] serving ok\n" in verdict and "queue_dominates_ttft" in verdict
    assert "output_throughput[tok/s] scenario=chat: - -> 100.5 (higher is better)" in verdict
    json.dumps(p.messages)  # plain data, ready for the ledger
    assert p.messages[-1]["role"] == "tool" and p.messages[-1]["content"] == "finished: the gate passes now"


def test_malformed_calls_come_back_as_errors_and_the_session_goes_on(state: LoopState, make_proposer,
                                                                     make_experiment) -> None:
    no_statement = {k: v for k, v in HYP.items() if k != "statement"}
    script = [
        {"tool_calls": [{"tool": "set_knobs", "arguments_text": '{"knobs": {"max_running": 64'},
                        {"tool": "shell", "arguments": {"cmd": "rm -rf /"}}]},
        {"tool_calls": [SET, {"tool": "run_experiment", "arguments": no_statement}]},
        {"tool_calls": [RUN, {"tool": "read_file", "arguments": {"path": "README.md"}}]},
    ]
    with serve_standin(script) as url:
        p = make_proposer(url)
        step = p.propose(state)
        assert step is not None and step.change.knobs == {"max_running": 64}
        done = make_experiment(step.hypothesis, step.change.knobs, outcome="refuted")
        p.observe(state, done)
        assert p.propose(state) is None  # the script is over: the stand-in sends finish
        reqs = received_requests(url)
    first = tool_messages(reqs[1])
    assert first["call_0_0"].startswith("set_knobs: the arguments are not valid JSON")
    assert first["call_0_1"].startswith("unknown tool 'shell'; the tools are: read_file")
    second = tool_messages(reqs[2])
    assert "run_experiment: invalid arguments: field 'statement': expected a value" in second["call_1_1"]
    third = tool_messages(reqs[3])
    assert third["call_2_1"] == "read_file: not run: run_experiment was called first in the same reply; " \
                                "call it again later if needed"
    assert "verdict: REFUTED" in third["call_2_0"]
    assert p.stopped_reason == "finished: the stand-in script has no more turns"


def test_401_names_the_variable(state: LoopState, make_proposer, monkeypatch: pytest.MonkeyPatch) -> None:
    with serve_standin({"require_key": "right-key-0000", "turns": [{"tool_calls": [SET]}]}) as url:
        with pytest.raises(InfraAgentError) as err:
            make_proposer(url, api_key="wrong-key-1234").propose(state)
        msg = str(err.value)
        assert "HTTP 401" in msg and "INFRA_AGENT_API_KEY" in msg and "OPENAI_API_KEY" in msg
        assert "the api_key argument" in msg and "wrong-key-1234" not in msg
        monkeypatch.setenv("OPENAI_API_KEY", "env-wrong-key-5678")
        with pytest.raises(InfraAgentError, match="the key came from OPENAI_API_KEY"):
            make_proposer(url).propose(state)
        monkeypatch.setenv("INFRA_AGENT_API_KEY", "right-key-0000")  # preferred over OPENAI_API_KEY
        p = make_proposer(url, max_turns=1)
        assert p.propose(state) is None and p.stopped_reason.startswith("max_turns")


def test_429_is_retried_with_backoff(state: LoopState, make_proposer, caplog: pytest.LogCaptureFixture) -> None:
    script = [{"tool_calls": [SET, RUN], "fail": {"status": 429, "times": 2}}]
    with serve_standin(script) as url, caplog.at_level(logging.WARNING):
        p = make_proposer(url, backoff_s=0.01)
        step = p.propose(state)
        assert step is not None and p.client.retries == 2
        assert [r["status"] for r in received_requests(url)] == [429, 429, 200]
    waits = [r.getMessage() for r in caplog.records if "HTTP 429" in r.getMessage()]
    assert len(waits) == 2 and "retry 1 of 4" in waits[0] and "retry 2 of 4" in waits[1]


def test_429_past_max_retries_is_an_error(state: LoopState, make_proposer) -> None:
    with serve_standin({"fail": {"status": 429, "times": 10}, "turns": []}) as url:
        with pytest.raises(InfraAgentError, match=r"kept answering HTTP 429 \(rate limit.*after 2 retries"):
            make_proposer(url, max_retries=2).propose(state)
        assert len(received_requests(url)) == 3


def test_a_slow_endpoint_times_out(state: LoopState, make_proposer) -> None:
    late = r"did not answer within the timeout of 0.5 s \(timeout_s\)"
    with serve_standin([{"text": "late", "delay_s": 5}]) as url, pytest.raises(InfraAgentError, match=late):
        make_proposer(url, timeout_s=0.5).propose(state)


def test_an_unreachable_endpoint(state: LoopState, make_proposer) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(InfraAgentError, match=f"cannot reach the LLM endpoint at {url}: "):
        make_proposer(url).propose(state)


def test_a_remote_endpoint_needs_a_key() -> None:
    with pytest.raises(InfraAgentError, match="set INFRA_AGENT_API_KEY .or OPENAI_API_KEY."):
        LLMProposer("m", "https://llm.example.com/v1")
    LLMProposer("m", "https://llm.example.com/v1", api_key="sk-x").close()


def test_max_turns_stops_the_session(state: LoopState, make_proposer) -> None:
    script = [{"tool_calls": [{"tool": "read_file", "arguments": {"path": "README.md"}}]}] * 5
    with serve_standin(script) as url:
        p = make_proposer(url, max_turns=3)
        assert p.propose(state) is None
        assert p.stopped_reason == "max_turns reached (3 model calls)"
        assert p.propose(state) is None
        assert len(received_requests(url)) == 3


def test_token_and_wall_caps(state: LoopState, make_proposer) -> None:
    script = [{"tool_calls": [{"tool": "read_file", "arguments": {"path": "README.md"}}]}] * 3
    with serve_standin(script) as url:
        p = make_proposer(url, max_tokens=10)
        assert p.propose(state) is None and p.stopped_reason.startswith("max_tokens reached")
        assert p.turns == 1
        q = make_proposer(url, max_wall_s=0)
        assert q.propose(state) is None and q.stopped_reason.startswith("max_wall_s reached") and q.turns == 0


def test_replies_without_tool_calls_are_nudged_then_given_up(state: LoopState, make_proposer) -> None:
    with serve_standin([{"text": "Let me think."}] * 3) as url:
        p = make_proposer(url)
        assert p.propose(state) is None
        assert p.stopped_reason == "the model answered 3 times without calling a tool"
        reqs = received_requests(url)
    assert reqs[1]["messages"][-1] == {"role": "user", "content": NUDGE}


def test_resume_from_saved_messages(state: LoopState, make_proposer, make_experiment) -> None:
    with serve_standin([{"tool_calls": [SET, RUN]}]) as url:
        p = make_proposer(url)
        step = p.propose(state)
        assert step is not None
        saved = json.loads(json.dumps(p.messages))  # what the ledger keeps: the run_experiment call is open
    done = make_experiment(step.hypothesis, step.change.knobs)
    with serve_standin([{"tool_calls": [{"tool": "finish", "arguments": {"reason": "resumed and done"}}]}]) as url:
        q = make_proposer(url)
        q.load_messages(saved)
        q.observe(state, done)
        assert q.propose(state) is None and q.stopped_reason == "finished: resumed and done"
        (req,) = received_requests(url)
    assert req["messages"][:len(saved)] == saved
    assert "verdict: SUPPORTED" in tool_messages(req)["call_0_1"]


def test_resume_answers_other_open_calls(make_proposer) -> None:
    q = make_proposer("http://127.0.0.1:9/v1")
    q.load_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]}])
    assert q.messages[-1] == {"role": "tool", "tool_call_id": "a",
                              "content": "not run: the session was interrupted before this call"}


def test_secrets_stay_out_of_the_conversation(state: LoopState, make_proposer) -> None:
    key = "sk-standin-0123456789"
    (state.code_root / "settings.env").write_text(f"MODEL_KEY_VALUE={key}\n")
    state.feedback[0].findings.append(Finding(kind="log", message="client sent Authorization: Bearer abcdefgh12345678"))
    script = [{"tool_calls": [{"tool": "read_file", "arguments": {"path": "settings.env"}}]}]
    with serve_standin(script) as url:
        make_proposer(url, api_key=key, max_turns=2).propose(state)
        reqs = received_requests(url)
    sent = json.dumps([r["messages"] for r in reqs])
    assert key not in sent and "abcdefgh12345678" not in sent and "***" in sent


def test_the_opening_message_keeps_head_and_gates_within_budget(state: LoopState) -> None:
    state.feedback[0].findings.extend(Finding(kind="noise", message=f"finding {i} " + "z" * 200) for i in range(400))
    state.feedback.append(state.feedback[0].model_copy())
    text = opening_message(state, token_budget=1000)
    assert len(text) <= 1000 * 4 + 200
    assert "- max_running: int in [1, 256]" in text
    assert "- tput: output_throughput>=1.05 @chat -> FAIL" in text
    assert "characters (" in text and "cut ...]" in text
    assert text.rstrip().endswith("call run_experiment.")
