"""Fuzz the HTTP API with random and malformed requests: never a 500, never a traceback.

Seeded and bounded: ``FUZZ_INPUTS`` inputs (a time budget stops it earlier on a slow
machine), thrown one at a time at /v1/completions and /v1/chat/completions (streaming
and not) and /v1/models: random bytes, truncated JSON, every field given a wrong type,
huge and negative numbers, deep nesting, invalid UTF-8, lone surrogates as JSON escapes
and as CESU-8 bytes, unsupported parameters, wrong content types, oversized bodies.
Afterwards the server must be healthy and serve a normal request, and its log must hold
no traceback.

    REFSTACK_FUZZ_SEED=7 REFSTACK_FUZZ_INPUTS=1000 python -m pytest -q -s tests/refstack/server/test_fuzz.py
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

FUZZ_SEED = int(os.environ.get("REFSTACK_FUZZ_SEED", "20261201"))
FUZZ_INPUTS = int(os.environ.get("REFSTACK_FUZZ_INPUTS", "300"))
TIME_BUDGET_S = float(os.environ.get("REFSTACK_FUZZ_BUDGET_S", "60"))
MIN_INPUTS = min(FUZZ_INPUTS, 100)  # what a slow machine must still get through

COMPLETIONS, CHAT, MODELS = "/v1/completions", "/v1/chat/completions", "/v1/models"
JSON_CT = "application/json"

COMPLETION_BODY: dict[str, Any] = {
    "model": "refstack-tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9,
    "seed": 1, "stop": ["\n", "zz"], "stream": False, "stream_options": {"include_usage": True},
    "ignore_eos": True, "logprobs": 2, "n": 1, "user": "fuzz",
}
CHAT_BODY: dict[str, Any] = {
    "model": "refstack-tiny", "messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hi \u00e9\U0001F600"}],
    "max_tokens": 4, "max_completion_tokens": 4, "temperature": 1.0, "top_p": 1.0, "seed": 2, "stop": "zz",
    "stream": False, "stream_options": {"include_usage": False}, "ignore_eos": False, "logprobs": True,
    "top_logprobs": 3, "tool_choice": "none", "response_format": {"type": "text"},
}
UNSUPPORTED = ["n", "best_of", "echo", "suffix", "frequency_penalty", "presence_penalty", "logit_bias", "tools",
               "tool_choice", "functions", "response_format", "modalities", "top_k", "min_p", "repetition_penalty",
               "min_tokens", "use_beam_search", "guided_json", "reasoning_effort", "audio"]

# Raw JSON values (text, so that non-standard and over-long ones survive).
WRONG_VALUES = [
    "null", "true", "false", "0", "-1", "1.5", "-0.0", '""', '"x"', '"5"', "[]", "{}", "[1, 2]", '["a", null]',
    '{"a": {"b": [1]}}', "18446744073709551616", "-9223372036854775809", "1e308", "-1e308", "1e309", "NaN",
    "Infinity", "-Infinity", "9" * 5000, "0." + "0" * 400 + "1", '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"',
    '"' + "\U0001F600" * 50 + '"', "[" * 50 + "]" * 50, '[{"role": "user", "content": 3}]',
    '[{"role": "user"}]', '[{"role": "x", "content": "y"}]', "[-1, 512, 100000000000]", "[" + "1," * 1000 + "1]",
]
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=xyz",
                 "application/json; charset=latin-1", "application/octet-stream", "", "application/json"]

Case = tuple[str, str, dict[str, str], bytes, str]  # method, path, headers, body, what


def _dumps(obj: Any, rng: random.Random) -> bytes:
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")


def _set_raw(body: dict[str, Any], path: list[str | int], raw: str, rng: random.Random) -> bytes:
    """Serialise ``body`` with the value at ``path`` replaced by raw JSON text."""
    marker = "__FUZZ_MARKER__"
    target: Any = body
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = marker
    return _dumps(body, rng).replace(json.dumps(marker).encode(), raw.encode("utf-8", "surrogatepass"))


def _fields(body: dict[str, Any]) -> list[list[str | int]]:
    paths: list[list[str | int]] = [[k] for k in body]
    for key in ("messages", "stream_options"):
        if isinstance(body.get(key), list):
            for i, msg in enumerate(body[key]):
                paths += [[key, i], *[[key, i, k] for k in msg]]
        elif isinstance(body.get(key), dict):
            paths += [[key, k] for k in body[key]]
    return paths


def _base(rng: random.Random) -> tuple[str, dict[str, Any]]:
    path = rng.choice([COMPLETIONS, CHAT])
    body = json.loads(json.dumps(COMPLETION_BODY if path == COMPLETIONS else CHAT_BODY))
    body["stream"] = rng.random() < 0.5
    for key in list(body):
        if key not in ("prompt", "messages") and rng.random() < 0.3:
            del body[key]
    return path, body


def _case(rng: random.Random) -> Case:
    kind = rng.choice(KINDS)
    return kind(rng)


def random_bytes(rng: random.Random) -> Case:
    return "POST", rng.choice([COMPLETIONS, CHAT]), {"content-type": JSON_CT}, rng.randbytes(rng.randint(0, 2000)), \
        "random bytes"


def truncated_json(rng: random.Random) -> Case:
    path, body = _base(rng)
    raw = _dumps(body, rng)
    return "POST", path, {"content-type": JSON_CT}, raw[: rng.randint(0, len(raw) - 1)], "truncated json"


def wrong_type(rng: random.Random) -> Case:
    path, body = _base(rng)
    field = rng.choice(_fields(body))
    return "POST", path, {"content-type": JSON_CT}, _set_raw(body, field, rng.choice(WRONG_VALUES), rng), \
        f"wrong value for {'.'.join(map(str, field))}"


def numbers(rng: random.Random) -> Case:
    path, body = _base(rng)
    field = rng.choice(["max_tokens", "max_completion_tokens", "seed", "temperature", "top_p", "logprobs",
                        "top_logprobs", "n"])
    value = rng.choice([-1, 0, -(2**63), 2**64, 10**30, -10**30, 2**31, 1e-300, -1e-300, 3.5, 513, 64, 63])
    raw = rng.choice([json.dumps(value), "1e400", "-1e400", "1" * rng.randint(300, 6000)])
    return "POST", path, {"content-type": JSON_CT}, _set_raw(body, [field], raw, rng), f"number in {field}"


def nesting(rng: random.Random) -> Case:
    depth = rng.choice([10, 1000, 5000, 100_000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    garbage = opener * depth + "1" + closer * depth
    if rng.random() < 0.5:
        return "POST", rng.choice([COMPLETIONS, CHAT]), {"content-type": JSON_CT}, garbage.encode(), \
            f"nested {depth} as body"
    path, body = _base(rng)
    field = rng.choice(_fields(body))
    return "POST", path, {"content-type": JSON_CT}, _set_raw(body, field, garbage, rng), f"nested {depth} in field"


def bad_utf8(rng: random.Random) -> Case:
    path, body = _base(rng)
    raw = _dumps(body, rng)
    junk = rng.choice([b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80",
                       b"\xed\xbf\xbf", b"\xc0\xaf", b"\x00", b"\xf8\x88\x80\x80\x80"])
    quote = raw.find(b'"', rng.randint(0, len(raw) - 1))
    at = quote + 1 if quote >= 0 else rng.randint(0, len(raw))
    return "POST", path, {"content-type": JSON_CT}, raw[:at] + junk + raw[at:], f"bytes {junk!r}"


def surrogates(rng: random.Random) -> Case:
    path, body = _base(rng)
    strings = [f for f in _fields(body) if isinstance(_get(body, f), str)]
    field = rng.choice(strings) if strings else ["prompt"]
    esc = rng.choice(["\\ud800", "\\udfff", "\\ud83d", "\\ude00\\ud83d", "ok\\udbff", "\\ud800\\ud800"])
    return "POST", path, {"content-type": JSON_CT}, _set_raw(body, field, f'"{esc}"', rng), f"surrogate {esc}"


def _get(body: Any, path: list[str | int]) -> Any:
    for part in path:
        body = body[part]
    return body


def unsupported(rng: random.Random) -> Case:
    path, body = _base(rng)
    for name in rng.sample(UNSUPPORTED, rng.randint(1, 3)):
        body[name] = rng.choice([1, 2, 0, -1, True, False, None, "auto", "x", [], [1], {}, {"type": "text"},
                                 {"type": "json_object"}, 0.5])
    return "POST", path, {"content-type": JSON_CT}, _dumps(body, rng), "unsupported parameters"


def content_type(rng: random.Random) -> Case:
    path, body = _base(rng)
    form = b'--xyz\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--xyz--\r\n'
    raw = rng.choice([_dumps(body, rng), b"prompt=hi&max_tokens=3", form, b""])
    ct = rng.choice(CONTENT_TYPES)
    return "POST", path, ({"content-type": ct} if ct else {}), raw, f"content-type {ct!r}"


def odd_documents(rng: random.Random) -> Case:
    raw = rng.choice([b"", b"null", b"[]", b'""', b"0", b"{}", b'{"prompt": "a", "prompt": 5}', b"\xef\xbb\xbf{}",
                      b'{"messages": []}', b'{"prompt": []}', b'{"prompt": ""}', b"{" * 3, b" " * 100,
                      b'{"model": "gpt-9", "prompt": "x"}', b'{"model": "\\ud800", "prompt": "x"}'])
    return "POST", rng.choice([COMPLETIONS, CHAT]), {"content-type": JSON_CT}, raw, f"document {raw[:20]!r}"


def oversized(rng: random.Random) -> Case:
    path, body = _base(rng)
    key = "prompt" if path == COMPLETIONS else "messages"
    body[key] = "x" * (2 << 20) if key == "prompt" else [{"role": "user", "content": "x" * (2 << 20)}]
    return "POST", path, {"content-type": JSON_CT}, _dumps(body, rng), "oversized"


def models(rng: random.Random) -> Case:
    method = rng.choice(["GET", "POST", "PUT", "DELETE"])
    return method, MODELS, {"content-type": rng.choice(CONTENT_TYPES) or JSON_CT}, rng.randbytes(rng.randint(0, 300)), \
        f"{method} /v1/models"


def valid(rng: random.Random) -> Case:
    path, body = _base(rng)
    return "POST", path, {"content-type": JSON_CT}, _dumps(body, rng), "valid-ish"


KINDS: list[Callable[[random.Random], Case]] = [
    random_bytes, truncated_json, wrong_type, wrong_type, wrong_type, numbers, nesting, bad_utf8, surrogates,
    unsupported, content_type, odd_documents, models, oversized, valid, valid,
]


@pytest.fixture(scope="module")
def fuzz_server(refstack_module_server_factory: Any) -> Any:
    # A short context keeps every valid request quick (chat without max_tokens fills it).
    return refstack_module_server_factory(["--max-seq-len", "64"])


def _problem(r: httpx.Response, body: bytes) -> str | None:
    """What is wrong with an answer, or None."""
    if r.status_code >= 500:
        return f"status {r.status_code}: {body[:300]!r}"
    if r.status_code in (400, 404, 409, 413):
        try:
            err = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return f"status {r.status_code} without an error body: {body[:300]!r}"
        if set(err) != {"message", "type", "param", "code"}:
            return f"error body of the wrong shape: {err}"
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        text = body.decode()
        if not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
            return f"stream did not end cleanly: {text[-300:]!r}"
    return None


def test_fuzz_never_500_and_server_stays_healthy(fuzz_server: Any) -> None:
    rng = random.Random(FUZZ_SEED)
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    tried = 0
    start = time.monotonic()
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as client:
        for _ in range(FUZZ_INPUTS):
            if time.monotonic() - start > TIME_BUDGET_S:
                break
            method, path, headers, content, what = _case(rng)
            try:
                with client.stream(method, path, headers=headers, content=content) as r:
                    body = r.read()
            except httpx.TransportError as exc:  # the server may close on an oversized body
                if what != "oversized":
                    failures.append(f"{method} {path} {what}: {type(exc).__name__}: {exc}")
                tried += 1
                continue
            tried += 1
            statuses[r.status_code] += 1
            problem = _problem(r, body)
            if problem:
                failures.append(f"{method} {path} {what}: {problem}")
    elapsed = time.monotonic() - start
    print(f"\nfuzz seed {FUZZ_SEED}: {tried} inputs in {elapsed:.1f} s, {len(failures)} failures, "
          f"statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:20])
    assert tried >= MIN_INPUTS, f"only {tried} inputs in the {TIME_BUDGET_S} s budget"
    assert statuses[200] and statuses[400], statuses  # the mix reached both sides
    # Healthy afterwards: /health, and a plain request of each kind.
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    for path, body in ((COMPLETIONS, {"prompt": "after the storm", "max_tokens": 3}),
                       (CHAT, {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})):
        r = httpx.post(fuzz_server.url + path, json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    log = fuzz_server.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
