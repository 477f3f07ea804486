"""Completions ``echo`` with ``logprobs``: teacher-forced prompt logprobs, as vLLM gives them.

The engine's prompt entries against the model's own log-softmax over every prompt
position (chunked prefill and batching included), and over HTTP: the echoed prompt's
logprobs equal the logprobs the server gave the same tokens when it generated them
(teacher forcing agrees with generation), the first token is null, top-N is sorted,
``max_tokens: 0`` returns the prompt alone, and what is not supported is a clear 400.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from refstack.engine import EngineConfig, SamplingParams
from refstack.model import SeqChunk
from refstack.server.logprobs import LogprobEngine, LogprobParams

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Prefill (chunked, all positions) and decode (one token at a time) differ at fp32 rounding.
TOL = 2e-3


def _engine(**kw: Any) -> LogprobEngine:
    return LogprobEngine(EngineConfig(preset="tiny", cpu_kernels="torch", dtype="float32", **kw))


def teacher_forced(engine: LogprobEngine, prompt: list[int]) -> torch.Tensor:
    """log-softmax (masked as the sampler masks) before each prompt token 1..L-1, from the model directly."""
    cache = engine.model.new_cache(num_slots=1, max_seq_len=engine.max_seq_len)
    _, rows = engine.model.forward_chunks_all_positions([SeqChunk(slot=0, token_ids=prompt, start_pos=0)], cache, [0])
    logits = rows[0][:-1].float().masked_fill(engine._unsampleable[: rows[0].shape[-1]], float("-inf"))
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("kw", [{}, {"prefill_chunk": 7, "max_batch_tokens": 16}, {"prefill_chunk": 5, "fuse_prefill_decode": True}])
def test_prompt_entries_are_the_models_teacher_forced_log_softmax(kw: dict[str, Any]) -> None:
    engine = _engine(**kw)
    tok = engine.tokenizer
    prompt = tok.encode("teacher forcing, chunk by chunk", add_bos=True)
    other = tok.encode("a neighbour in the batch", add_bos=True)
    params = LogprobParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=4, prompt_logprobs=True)
    plain = SamplingParams(max_tokens=3, temperature=1.0, seed=9, ignore_eos=True)
    out, neighbour = engine.generate([prompt, other], [params, plain])
    assert len(params.prompt_entries) == len(prompt) - 1 and len(params.entries) == 3
    ref = teacher_forced(engine, prompt)
    for j, (tid, lp, top) in enumerate(params.prompt_entries):
        assert tid == prompt[j + 1]
        assert lp == pytest.approx(float(ref[j, tid]), abs=1e-4)
        values, ids = ref[j].topk(4)
        assert [i for i, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    # The neighbour samples exactly as it would alone: the echo request costs it nothing.
    (alone,) = _engine(**kw).generate([other], SamplingParams(max_tokens=3, temperature=1.0, seed=9, ignore_eos=True))
    assert neighbour.token_ids == alone.token_ids
    # Generation itself is unchanged by asking for the prompt's logprobs.
    (again,) = _engine(**kw).generate([prompt], LogprobParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=4))
    assert again.token_ids == out.token_ids


def test_one_token_prompt_has_no_prompt_entries() -> None:
    engine = _engine()
    params = LogprobParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    engine.generate([[engine.tokenizer.bos_id]], params)
    assert params.prompt_entries == [] and len(params.entries) == 2


# ---- over HTTP ----

def _post(server: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + COMPLETIONS, json=body, timeout=60)


@pytest.fixture(scope="module")
def chunked_server(refstack_module_server_factory: Any) -> Any:
    # Small prefill pieces: a prompt's logprobs are assembled over several engine steps.
    return refstack_module_server_factory(["--prefill-chunk", "6", "--max-batch-tokens", "16"])


@pytest.mark.parametrize("which", ["default", "chunked"])
def test_echoed_prompt_logprobs_equal_the_generated_ones(refstack_server: Any, chunked_server: Any, which: str) -> None:
    """Generate, then echo the prompt plus the generation back: teacher forcing must agree."""
    server = refstack_server if which == "default" else chunked_server
    gen = _post(server, {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                         "logprobs": 5}).json()["choices"][0]
    prompt_ids = [256, *b"The quick brown fox"]  # <|bos|> and the bytes, as the server encodes it
    generated = gen["logprobs"]
    # The generated ids, from their texts (a byte tokenizer: one id per byte, specials by name).
    ids = [ord(t) if len(t) == 1 else int(t[-2:], 16) if t.startswith("bytes:") else None for t in generated["tokens"]]
    assert None not in ids, generated["tokens"]
    body = {"prompt": prompt_ids + ids, "max_tokens": 0, "echo": True, "logprobs": 5}
    echoed = _post(server, body)
    assert echoed.status_code == 200, echoed.text
    choice = echoed.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(prompt_ids) + len(ids)
    assert all(len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["tokens"][0] == "<|bos|>"
    tail = slice(len(prompt_ids), n)
    assert lp["tokens"][tail] == generated["tokens"]
    assert lp["token_logprobs"][tail] == pytest.approx(generated["token_logprobs"], abs=TOL)
    for mine, theirs in zip(lp["top_logprobs"][tail], generated["top_logprobs"]):
        assert set(mine) == set(theirs)
        assert [mine[k] for k in theirs] == pytest.approx(list(theirs.values()), abs=TOL)
    for top, tok, value in zip(lp["top_logprobs"][1:], lp["tokens"][1:], lp["token_logprobs"][1:]):
        assert top[tok] == value <= 0.0
        assert len(top) in (5, 6)  # the top 5, and the actual token when it is not among them
        ranked = list(top.values())[:5]
        assert ranked == sorted(ranked, reverse=True)  # best first
    assert choice["finish_reason"] == "length" and echoed.json()["usage"]["completion_tokens"] == 0


def test_echo_with_generation_puts_the_prompt_first(refstack_server: Any) -> None:
    body = {"prompt": "Echo me", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    plain = _post(refstack_server, body).json()
    echoed = _post(refstack_server, {**body, "echo": True}).json()
    c = echoed["choices"][0]
    assert c["text"] == "Echo me" + plain["choices"][0]["text"]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == 8 + 4 and lp["tokens"][-4:] == plain["choices"][0]["logprobs"]["tokens"]
    assert lp["text_offset"][:9] == [0, 0, 1, 2, 3, 4, 5, 6, 7]  # <|bos|> prints nothing
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert echoed["usage"] == plain["usage"] == {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12}
    no_lp = _post(refstack_server, {"prompt": "Echo me", "max_tokens": 0, "echo": True}).json()["choices"][0]
    assert no_lp["text"] == "Echo me" and no_lp["logprobs"] is None


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    (COMPLETIONS, {"prompt": "x", "echo": True, "stream": True, "logprobs": 1}, "echo", "unsupported_value"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "n": 2}, "n", "unsupported_value"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens", "invalid_value"),
    (COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens", "invalid_value"),
    (COMPLETIONS, {"prompt": "x", "echo": 1}, "echo", None),  # strictly a bool
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo", "unsupported_value"),
])
def test_unsupported_echo_combinations_are_a_clear_400(refstack_server: Any, path: str, body: dict[str, Any],
                                                       param: str, code: str | None) -> None:
    r = httpx.post(refstack_server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err
