"""Byte-level tokenizer: exact round trips, streaming across split UTF-8, chat template."""

from __future__ import annotations

import pytest

from refstack.model import ByteTokenizer, HybridConfig
from refstack.model.tokenizer import UnencodableTextError


def test_round_trip_with_multibyte_text() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🚀!"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id, tok.pad_id, 400]) == text  # specials and unused ids skipped


def test_stream_decoder_holds_back_partial_characters() -> None:
    tok = ByteTokenizer()
    text = "a🚀é日"
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    pieces = [dec.feed(i) for i in ids]
    # "🚀" is 4 bytes: nothing is emitted until its last byte arrives.
    assert pieces[:5] == ["a", "", "", "", "🚀"]
    assert "".join(pieces) + dec.flush() == text
    assert "\ufffd" not in "".join(pieces)


def test_stream_decoder_ignores_specials_and_flushes_dangling_bytes() -> None:
    tok = ByteTokenizer()
    dec = tok.stream_decoder()
    assert dec.feed(tok.im_start_id) == ""
    assert dec.feed_many(list(b"ok")) == "ok"
    assert dec.feed(0xE6) == ""  # first byte of a 3-byte character, then the stream ends
    assert dec.flush() == "\ufffd"


def test_special_token_text_stays_plain_bytes() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("<|im_end|>")
    assert tok.im_end_id not in ids and tok.decode(ids) == "<|im_end|>"


def test_chat_template() -> None:
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == tok.bos_id
    assert ids.count(tok.im_start_id) == 3 and ids.count(tok.im_end_id) == 2
    tail = tok.encode("assistant\n")
    assert ids[-len(tail) - 1 :] == [tok.im_start_id, *tail]
    first_turn = ids[1 : ids.index(tok.im_end_id) + 1]
    assert first_turn == [tok.im_start_id, *tok.encode("system\nbe brief"), tok.im_end_id]
    assert tok.decode(ids) == "system\nbe brief\nuser\nhi\nassistant\n"
    assert set(tok.eos_token_ids) == {tok.eos_id, tok.im_end_id}


def test_model_vocab_covers_tokenizer() -> None:
    tok = ByteTokenizer()
    for name in ("tiny", "small"):
        assert HybridConfig.preset(name).vocab_size >= tok.vocab_size


def test_lone_surrogate_is_refused_with_its_position() -> None:
    tok = ByteTokenizer()
    with pytest.raises(UnencodableTextError, match=r"lone surrogate U\+D800 at index 2") as err:
        tok.encode("ok\ud800!")
    assert isinstance(err.value, ValueError) and err.value.index == 2
    with pytest.raises(UnencodableTextError, match=r"U\+DFFF"):
        tok.apply_chat_template([{"role": "user", "content": "\udfff"}])
    # A proper pair is one character (U+1F600) and encodes as its 4 UTF-8 bytes.
    assert tok.encode("\U0001F600") == list("\U0001F600".encode())


def test_token_text_and_bytes_name_every_id() -> None:
    tok = ByteTokenizer()
    assert (tok.token_text(ord("a")), tok.token_bytes(ord("a"))) == ("a", b"a")
    assert (tok.token_text(0xE6), tok.token_bytes(0xE6)) == ("bytes:\\xe6", b"\xe6")
    assert (tok.token_text(tok.eos_id), tok.token_bytes(tok.eos_id)) == ("<|eos|>", None)
    assert len({tok.token_text(i) for i in range(tok.vocab_size)}) == tok.vocab_size  # distinct names
