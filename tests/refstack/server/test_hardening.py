"""Bad input answered with 4xx, never 500: lone surrogates, unknown models, unsupported
parameters, oversized bodies; and /debug/trace says when tracing is off."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def post_raw(url: str, path: str, body: bytes, **kw: Any) -> httpx.Response:
    """POST exact bytes (httpx's ``json=`` cannot send a lone surrogate: it encodes to UTF-8)."""
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err
    return err


# ---- lone surrogates (item 4): 400 naming the field, for chat, completions, streaming ----

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "param"), [
    (COMPLETIONS, {"prompt": "ab\ud800", "max_tokens": 2}, "prompt"),
    (COMPLETIONS, {"prompt": "\udfff", "max_tokens": 2}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "stop": ["x", "\ud83d"]}, "stop.1"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "\ude00\ud83d"}],
            "max_tokens": 2}, "messages.1.content"),
])
def test_lone_surrogate_escape_is_a_400(refstack_server: Any, stream: bool, path: str, body: dict[str, Any],
                                         param: str) -> None:
    raw = json.dumps({**body, "stream": stream}).encode()  # ensure_ascii: the surrogate travels as \udXXX
    assert b"\\ud" in raw
    err = assert_error(post_raw(refstack_server.url, path, raw), 400, param, "invalid_value")
    assert "lone surrogate" in err["message"] and err["type"] == "invalid_request_error"


def test_surrogate_smuggled_as_utf8_bytes_is_a_400(refstack_server: Any) -> None:
    # ED A0 80 is U+D800 in CESU-8: not UTF-8, but Python's JSON decoder lets it through.
    raw = b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'
    assert_error(post_raw(refstack_server.url, COMPLETIONS, raw), 400, "prompt", "invalid_value")


def test_surrogate_pair_is_a_character_not_an_error(refstack_server: Any) -> None:
    raw = json.dumps({"prompt": "\U0001F600", "max_tokens": 2, "ignore_eos": True}).encode()
    assert b"\\ud83d\\ude00" in raw
    r = post_raw(refstack_server.url, COMPLETIONS, raw)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5  # bos + 4 bytes


@pytest.mark.parametrize("raw", [b"1" * 5000, b"[" * 100_000, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"],
                         ids=["5000-digit-number", "deep-nesting", "5000-digit-field"])
def test_json_the_decoder_cannot_take_is_a_400(refstack_server: Any, raw: bytes) -> None:
    # Deep nesting (RecursionError) and >4300-digit integers (ValueError) are no JSONDecodeError.
    assert_error(post_raw(refstack_server.url, COMPLETIONS, raw), 400, None, "invalid_json")


@pytest.mark.parametrize("extra", [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-40, "top_p": 5e-324}])
def test_tiny_temperature_and_top_p_do_not_break_the_engine(refstack_server: Any, extra: dict[str, Any]) -> None:
    # In float32 these became a division by zero and an empty top-p set: the engine's
    # step failed, and with it every request in the batch.
    body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True, **extra}
    r = httpx.post(refstack_server.url + COMPLETIONS, json=body, timeout=60)
    greedy = httpx.post(refstack_server.url + COMPLETIONS, json={**body, "temperature": 0, "top_p": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]  # both keep just the best token
    assert "Traceback" not in refstack_server.log()


@pytest.mark.parametrize("param", ["temperature", "top_p"])
@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_sampling_parameter_is_named_as_such(refstack_server: Any, param: str, raw: str) -> None:
    # Python's JSON reader takes NaN; every range check is false for it, so the answer used
    # to be "Input should be less than or equal to 2" for a value that is not a number.
    body = b'{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (param.encode(), raw.encode())
    err = assert_error(post_raw(refstack_server.url, COMPLETIONS, body), 400, param, "invalid_value")
    assert "finite number" in err["message"] and "less than" not in err["message"], err


@pytest.mark.parametrize(("path", "param"), [
    (COMPLETIONS, "presence_penalty"), (CHAT, "presence_penalty"), (COMPLETIONS, "frequency_penalty"),
    (CHAT, "frequency_penalty"), (COMPLETIONS, "min_p"), (CHAT, "repetition_penalty"), (COMPLETIONS, "top_k"),
    (COMPLETIONS, "n"), (COMPLETIONS, "best_of"),
])
@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_value_of_an_unsupported_number_is_named_as_such(refstack_server: Any, path: str, param: str,
                                                                      raw: str) -> None:
    # NaN equals no neutral value, so these were answered "not supported ... set it to null
    # or 0", as if a penalty of NaN were a setting refstack merely lacks.
    prompt = b'"prompt": "hi"' if path == COMPLETIONS else b'"messages": [{"role": "user", "content": "hi"}]'
    body = b'{%s, "max_tokens": 2, "%s": %s}' % (prompt, param.encode(), raw.encode())
    err = assert_error(post_raw(refstack_server.url, path, body), 400, param, "invalid_value")
    assert err["message"] == f"'{param}': Input should be a finite number", err
    # A finite value that is not the neutral one is still the unsupported parameter it was.
    finite = b'{%s, "max_tokens": 2, "%s": 0.5}' % (prompt, param.encode())
    assert_error(post_raw(refstack_server.url, path, finite), 400, param, "unsupported_value")


# ---- models (item 9): an unknown name is a 404; the served one and no model work ----

@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_unknown_model_is_a_404(refstack_server: Any, path: str) -> None:
    body: dict[str, Any] = {"model": "gpt-9", "max_tokens": 2, "stream": path == CHAT}
    body.update({"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]})
    err = assert_error(httpx.post(refstack_server.url + path, json=body, timeout=60), 404, "model", "model_not_found")
    assert err["message"] == "The model `gpt-9` does not exist." and err["type"] == "not_found_error"
    for model in ("refstack-tiny", None):
        r = httpx.post(refstack_server.url + path, json={**body, "model": model, "stream": False}, timeout=60)
        assert r.status_code == 200, r.text


# ---- unsupported parameters (item 9): rejected alike unless at their neutral value ----

@pytest.mark.parametrize(("path", "extra"), [
    (COMPLETIONS, {"n": 3}),
    (CHAT, {"n": 2}),
    (COMPLETIONS, {"n": True}),  # a bool is no 1
    (COMPLETIONS, {"best_of": 2}),
    (CHAT, {"echo": True}),  # completions echo (test_echo_logprobs.py); chat does not
    (COMPLETIONS, {"suffix": "end"}),
    (COMPLETIONS, {"frequency_penalty": 0.5}),
    (CHAT, {"presence_penalty": -1}),
    (CHAT, {"logit_bias": {"5": 100}}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    (CHAT, {"tool_choice": "required"}),
    (CHAT, {"response_format": {"type": "json_object"}}),
    (CHAT, {"modalities": ["text", "audio"]}),
    (CHAT, {"reasoning_effort": "high"}),
    (COMPLETIONS, {"top_k": 5}),
    (COMPLETIONS, {"repetition_penalty": 1.2}),
    (COMPLETIONS, {"min_tokens": 3}),
])
def test_unsupported_parameters_are_rejected_alike(refstack_server: Any, path: str, extra: dict[str, Any]) -> None:
    base: dict[str, Any] = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    (name,) = extra
    r = httpx.post(refstack_server.url + path, json={**base, "max_tokens": 2, **extra}, timeout=60)
    err = assert_error(r, 400, name, "unsupported_value")
    assert err["message"].startswith(f"'{name}' is not supported by refstack")


@pytest.mark.parametrize(("path", "extra"), [
    (COMPLETIONS, {"n": 1, "best_of": 1, "echo": False, "suffix": None, "frequency_penalty": 0,
                   "presence_penalty": 0.0, "logit_bias": {}, "user": "someone", "top_k": -1,
                   "repetition_penalty": 1.0, "min_tokens": 0, "logprobs": None}),
    (CHAT, {"n": 1, "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "metadata": {"a": "b"},
            "store": False, "service_tier": "auto", "response_format": {"type": "text"}, "modalities": ["text"],
            "logit_bias": None, "reasoning_effort": None, "logprobs": False, "top_logprobs": None}),
])
def test_neutral_values_of_unsupported_parameters_are_accepted(refstack_server: Any, path: str,
                                                               extra: dict[str, Any]) -> None:
    base: dict[str, Any] = {"prompt": "hi"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(refstack_server.url + path, json={**base, "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 200, r.text


def test_every_openai_parameter_is_classified() -> None:
    from refstack.server.protocol import ChatCompletionRequest, CompletionRequest

    for model in (CompletionRequest, ChatCompletionRequest):
        classes = model.parameter_classes()
        assert set(classes) >= set(model.OPENAI_PARAMETERS), set(model.OPENAI_PARAMETERS) - set(classes)
        assert set(classes.values()) <= {"implemented", "ignored", "rejected"}
    assert CompletionRequest.parameter_classes()["logprobs"] == "implemented"
    assert ChatCompletionRequest.parameter_classes()["top_logprobs"] == "implemented"
    assert ChatCompletionRequest.parameter_classes()["tools"] == "rejected"


# ---- request size (item 10): 413 before the body is read ----

def _http(url: str, head: str, body: bytes = b"", read_timeout: float = 20.0) -> tuple[int, dict[str, str], bytes]:
    """Send a request head (and maybe some body) on a raw socket; the status, headers and body of the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=read_timeout) as conn:
        conn.sendall(head.encode() + body)
        got = b""
        while b"\r\n\r\n" not in got:
            data = conn.recv(1 << 16)
            assert data, f"closed without an answer: {got!r}"
            got += data
        head_bytes, _, rest = got.partition(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            data = conn.recv(1 << 16)
            if not data:
                break
            rest += data
        return int(lines[0].split()[1]), headers, rest


def test_declared_oversized_body_gets_413_without_being_sent(refstack_server: Any) -> None:
    # 100 MB declared, nothing sent: the answer must come from the headers alone.
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: refstack\r\nContent-Type: application/json\r\n"
            f"Content-Length: {100 * 1024 * 1024}\r\n\r\n")
    status, headers, body = _http(refstack_server.url, head)
    assert status == 413 and headers.get("connection") == "close"
    err = json.loads(body)["error"]
    assert (err["code"], err["param"]) == ("request_too_large", None) and "1048576" in err["message"]
    assert httpx.get(refstack_server.url + "/health").status_code == 200


@pytest.fixture(scope="module")
def small_body_server(refstack_module_server_factory: Any) -> Any:
    return refstack_module_server_factory(["--max-request-bytes", "4096"])


def test_chunked_body_is_counted_as_it_arrives(small_body_server: Any) -> None:
    # No Content-Length: the server counts the chunks and stops at the one past the limit.
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: refstack\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b'{"prompt": "' + b"x" * 1000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5))  # 5 KB > 4 KB, never terminated
    status, headers, reply = _http(small_body_server.url, head, body)
    assert status == 413 and headers.get("connection") == "close"
    assert json.loads(reply)["error"]["code"] == "request_too_large"


def test_bodies_under_the_limit_pass_and_over_it_get_413(small_body_server: Any) -> None:
    url = small_body_server.url
    ok = {"prompt": "x" * 100, "max_tokens": 2}
    assert httpx.post(url + COMPLETIONS, json=ok, timeout=60).status_code == 200
    r = httpx.post(url + COMPLETIONS, json={"prompt": "x" * 5000, "max_tokens": 2}, timeout=60)
    err = assert_error(r, 413, None, "request_too_large")
    assert "--max-request-bytes" in err["message"]
    # A chunked body under the limit is read whole.
    chunks = iter([json.dumps(ok).encode()[:10], json.dumps(ok).encode()[10:]])
    assert httpx.post(url + COMPLETIONS, content=chunks, timeout=60).status_code == 200
    engine = httpx.get(url + "/debug/engine", timeout=10).json()
    assert engine["server"]["max_request_bytes"] == 4096


# ---- /debug/trace with tracing off (item 12d) ----

def test_trace_endpoint_says_tracing_is_off(refstack_server: Any) -> None:
    r = httpx.get(refstack_server.url + "/debug/trace", timeout=10)
    err = assert_error(r, 409, None, "tracing_disabled")
    assert "--trace" in err["message"]
