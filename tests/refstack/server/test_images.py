"""Images in chat requests over HTTP: the same greedy tokens from --disagg epd as from one
engine, a 400 naming the part for every bad image (the server stays up), encode metrics."""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from refstack.encode.images import data_url, encode_png  # noqa: E402

FLAGS = ("--max-seq-len", "512", "--dtype", "float32")


def _png(seed: int, w: int = 48, h: int = 40) -> str:
    return data_url(encode_png(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)))


def _jpeg(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (30, 50, 3), dtype=np.uint8)).save(buf, "JPEG")
    return data_url(buf.getvalue(), "image/jpeg")


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _chat(url: str, content: Any, **extra: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "logprobs": True, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


# One image, two images, a JPEG, the first picture again (an encoder cache hit), text-only parts.
CONVERSATIONS: list[Any] = [
    [{"type": "text", "text": "What is in this picture?"}, _image(_png(1))],
    [_image(_png(2)), {"type": "text", "text": "and"}, _image(_png(3, 90, 20))],
    [{"type": "text", "text": "Describe:"}, _image(_jpeg(4))],
    [{"type": "text", "text": "What is in this picture?"}, _image(_png(1))],
    [{"type": "text", "text": "Only text in parts."}],
]


def _answers(url: str) -> list[Any]:
    out = []
    for content in CONVERSATIONS:
        r = _chat(url, content)
        assert r.status_code == 200, r.text
        body = r.json()
        out.append(([e["token"] for e in body["choices"][0]["logprobs"]["content"]], body["usage"]["prompt_tokens"]))
    return out


@pytest.fixture(scope="module")
def mono(refstack_module_server_factory: Any) -> Any:
    return refstack_module_server_factory(FLAGS)


@pytest.fixture(scope="module")
def baseline(mono: Any) -> list[Any]:
    return _answers(mono.url)


def test_images_take_their_placeholders(baseline: list[Any]) -> None:
    # 64 placeholder tokens per image on tiny; the repeated picture gives the same tokens.
    text_only = baseline[4][1]
    assert baseline[1][1] == baseline[0][1] - len("What is in this picture?") + len("and") + 64
    assert baseline[0] == baseline[3]
    assert text_only < 64
    assert all(len(tokens) == 10 for tokens, _ in baseline)


@pytest.fixture(scope="module")
def epd(refstack_module_server_factory: Any) -> Any:
    return refstack_module_server_factory([*FLAGS, "--disagg", "epd", "--encode-workers", "2",
                                           "--encode-batch-size", "4", "--trace", "true"])


def test_epd_gives_the_tokens_of_one_engine(baseline: list[Any], epd: Any, scrape: Any) -> None:
    server = epd
    assert _answers(server.url) == baseline
    info = httpx.get(server.url + "/debug/engine", timeout=10).json()
    assert {"prefill", "decode", "encode0", "encode1"} <= set(info["disagg"]["workers"])
    metrics = scrape(server.url)
    # Four requests carried images; the text-only one is no sample of the encode phase.
    assert metrics["refstack:request_encode_time_seconds_count"] == 4
    assert metrics["refstack:request_encode_transfer_time_seconds_count"] == 4
    trace = httpx.get(server.url + "/debug/trace", timeout=30).json()
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"encode", "encode.put", "encode.fetch"} <= names


def test_inline_encode_is_measured(mono: Any, baseline: list[Any], scrape: Any) -> None:
    metrics = scrape(mono.url)
    assert metrics["refstack:request_encode_time_seconds_count"] >= 4
    assert metrics["refstack:request_encode_transfer_time_seconds_sum"] == 0.0  # inline: nothing moves


def _truncated_png() -> str:
    raw = encode_png(np.random.default_rng(7).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    return data_url(raw[: len(raw) // 2])


def _huge_png() -> str:
    # A valid header claiming 20000 x 20000 pixels: refused from the header, never decoded.
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, "PNG")
    return data_url(buf.getvalue())


BAD = [
    ("https://example.com/cat.png", "remote"),
    ("data:image/png;base64,@@@not base64@@@", "base64"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "media type"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a not a png").decode(), "not a PNG or JPEG"),
    ("data:image/png," + "abc", "base64"),
    (None, "truncated"),
    (None, "at most"),
    ("data:image/jpeg;base64," + _png(9).split(",", 1)[1], "says image/jpeg"),
]


@pytest.mark.parametrize("url,words", BAD, ids=[w for _, w in BAD])
def test_every_bad_image_gets_a_400_naming_its_part(mono: Any, url: str | None, words: str) -> None:
    if url is None:
        url = _truncated_png() if words == "truncated" else _huge_png()
    r = _chat(mono.url, [{"type": "text", "text": "look"}, _image(_png(1)), _image(url)])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.2.image_url.url", err
    assert words in err["message"], err
    assert httpx.get(mono.url + "/health", timeout=10).status_code == 200
    assert _chat(mono.url, [_image(_png(1))]).status_code == 200


def test_a_part_of_an_unknown_type_is_a_400(mono: Any) -> None:
    r = _chat(mono.url, [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith("messages.0.content")


def test_prefill_decode_disagg_refuses_images_and_serves_text(refstack_module_server_factory: Any) -> None:
    server = refstack_module_server_factory([*FLAGS, "--disagg", "true"])
    r = _chat(server.url, [{"type": "text", "text": "look"}, _image(_png(1))])
    assert r.status_code == 400 and "--disagg epd" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.1.image_url.url"
    assert _chat(server.url, [{"type": "text", "text": "only text"}]).status_code == 200


def test_a_client_gone_while_its_images_encode_leaves_nothing_behind(epd: Any, scrape: Any) -> None:
    before = scrape(epd.url).get("refstack:request_aborted_total", 0.0)
    content = [{"type": "text", "text": "many"}] + [_image(_png(100 + i, 200, 200)) for i in range(6)]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 50, "stream": True}
    for _ in range(3):  # the client hangs up at once: while its images encode, or just after
        with httpx.stream("POST", epd.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = httpx.get(epd.url + "/debug/engine", timeout=10).json()
        if info["num_waiting"] == 0 and info["num_running"] == 0:
            break
        time.sleep(0.2)
    assert (info["num_waiting"], info["num_running"]) == (0, 0), info
    assert scrape(epd.url)["refstack:request_aborted_total"] - before == 3
    assert _chat(epd.url, [_image(_png(1))]).status_code == 200
