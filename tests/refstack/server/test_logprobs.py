"""logprobs / top_logprobs: the engine's numbers against the model's, and OpenAI's shapes
for completions and chat, streaming and not."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
import torch

from refstack.engine import EngineConfig, SamplingParams
from refstack.model import SeqChunk
from refstack.server.logprobs import LogprobEngine, LogprobParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def engine() -> LogprobEngine:
    return LogprobEngine(EngineConfig(preset="tiny", cpu_kernels="torch", dtype="float32"))


def reference_logprobs(engine: LogprobEngine, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The masked log-softmax before each generated token, from the model directly."""
    cache = engine.model.new_cache(num_slots=1, max_seq_len=engine.max_seq_len)
    rows = [engine.model.forward_chunks([SeqChunk(slot=0, token_ids=prompt, start_pos=0)], cache)[0]]
    for i, tok in enumerate(tokens[:-1]):
        rows.append(engine.model.forward_chunks([SeqChunk(slot=0, token_ids=[tok], start_pos=len(prompt) + i)],
                                                cache)[0])
    out = []
    for row in rows:
        row = row.float().masked_fill(engine._unsampleable[: row.shape[-1]], float("-inf"))
        out.append(torch.log_softmax(row, dim=-1))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_entries_are_the_models_log_softmax(engine: LogprobEngine, temperature: float) -> None:
    prompt = engine.tokenizer.encode("logprobs, please", add_bos=True)
    params = LogprobParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True, logprobs=4)
    out = engine.generate([prompt], params)[0]
    assert [e[0] for e in params.entries] == list(out.token_ids) and len(params.entries) == 6
    for (tok, lp, top), ref in zip(params.entries, reference_logprobs(engine, prompt, list(out.token_ids))):
        assert lp == pytest.approx(float(ref[tok]), abs=1e-4)
        values, ids = ref.topk(4)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
        if temperature == 0.0:
            assert tok == top[0][0]  # greedy takes the best token
        assert sum(math.exp(v) for _, v in top) <= 1.0 + 1e-5


def test_logprobs_do_not_change_sampling_and_skip_other_requests(engine: LogprobEngine) -> None:
    tok = engine.tokenizer
    prompts = [tok.encode("first", add_bos=True), tok.encode("second one", add_bos=True)]
    plain = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    with_lp = LogprobParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, logprobs=2)
    a, b = engine.generate(prompts, [plain, with_lp])  # one batch: a request with, one without
    (solo,) = engine.generate([prompts[1]], plain)
    assert b.token_ids == solo.token_ids and len(with_lp.entries) == 8
    assert len(a.token_ids) == 8


# ---- over HTTP ----

def _events(r: httpx.Response) -> list[dict[str, Any]]:
    import json

    out = []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_completion_logprobs_shape_and_streaming_agree(refstack_server: Any) -> None:
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    whole = httpx.post(refstack_server.url + COMPLETIONS, json=body, timeout=60).json()
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(lp[k]) == 6 for k in lp) and whole["usage"]["completion_tokens"] == 6
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert isinstance(tok, str) and value <= 0.0
        assert len(top) == 3 and top[tok] == value == max(top.values())  # greedy: the chosen token is the best
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] <= len(choice["text"])
    with httpx.stream("POST", refstack_server.url + COMPLETIONS, json={**body, "stream": True}, timeout=60) as r:
        events = _events(r)
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"] is not None]
    assert sum(len(p["tokens"]) for p in parts) == 6
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["choices"][0]["logprobs"] is None
    for key in lp:
        joined = [x for p in parts for x in p[key]]
        assert joined == (pytest.approx(lp[key]) if key == "token_logprobs" else lp[key]), key


def test_completion_logprobs_zero_reports_only_the_chosen_token(refstack_server: Any) -> None:
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True, "logprobs": 0}
    lp = httpx.post(refstack_server.url + COMPLETIONS, json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_chat_logprobs_shape_and_streaming_agree(refstack_server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    whole = httpx.post(refstack_server.url + CHAT, json=body, timeout=60).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] is None or all(0 <= b < 256 for b in entry["bytes"])
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    with httpx.stream("POST", refstack_server.url + CHAT, json={**body, "stream": True}, timeout=60) as r:
        events = _events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["choices"][0]["logprobs"] is None
    streamed = [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["content"]]
    assert [x["token"] for x in streamed] == [x["token"] for x in content]
    assert [x["logprob"] for x in streamed] == pytest.approx([x["logprob"] for x in content])
    # Without logprobs the field stays null.
    plain = httpx.post(refstack_server.url + CHAT, json={**body, "logprobs": False, "top_logprobs": None}, timeout=60)
    assert plain.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("path", "extra", "param"), [
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"logprobs": 1}, "logprobs"),  # chat's logprobs is a bool
    (COMPLETIONS, {"logprobs": True}, "logprobs"),  # completions' is an int
    (COMPLETIONS, {"logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs"),
])
def test_bad_logprobs_values_are_400(refstack_server: Any, path: str, extra: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(refstack_server.url + path, json={**base, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
