"""The encoder and the splice: seeded weights, the chat template, the cache, and image
embeddings that give the same logits whether the prompt is prefilled whole or in chunks."""

from __future__ import annotations

import numpy as np
import torch

from refstack.encode.encoder import Encoder, EncoderConfig
from refstack.encode.mm import (
    IMAGE_TOKEN_ID,
    EncoderCache,
    ImageItem,
    MMInput,
    chat_prompt,
    encode_with_cache,
)
from refstack.model import ByteTokenizer, HybridConfig, SeqChunk
from refstack.model.model import HybridModel

CFG = EncoderConfig.for_model("tiny", 64, 0)


def _pixels(seed: int, n: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, CFG.image_size, CFG.image_size, 3), dtype=np.uint8)


def test_encoder_is_seeded_and_batch_independent() -> None:
    a, b = Encoder(CFG), Encoder(CFG)
    px = _pixels(0, 3)
    out = a.encode(px)
    assert out.shape == (3, CFG.tokens_per_image, 64)
    assert torch.equal(out, b.encode(px))
    torch.testing.assert_close(out[1:2], a.encode(px[1:2]), rtol=1e-5, atol=1e-5)
    other = Encoder(EncoderConfig.for_model("tiny", 64, 1)).encode(px)
    assert not torch.allclose(out, other)


def test_chat_prompt_text_only_matches_the_template() -> None:
    tok = ByteTokenizer()
    msgs = [("system", ["be brief"]), ("user", ["hello ", "there"])]
    ids, offsets = chat_prompt(tok, msgs, 64)
    assert ids == tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "hello there"}])
    assert offsets == []
    ids, offsets = chat_prompt(tok, [("user", ["see ", 0, "!"])], 64)
    assert ids[offsets[0] : offsets[0] + 64] == [IMAGE_TOKEN_ID] * 64
    assert IMAGE_TOKEN_ID not in ids[: offsets[0]] + ids[offsets[0] + 64 :]


def test_cache_hits_skip_the_encoder_and_evict_oldest() -> None:
    enc, cache = Encoder(CFG), EncoderCache(2)
    px = _pixels(1, 3)
    items = [ImageItem(0, CFG.tokens_per_image, f"k{i}", px[i]) for i in range(3)]
    assert encode_with_cache(enc, cache, items[:2], batch_size=1) == 2
    again = [ImageItem(0, CFG.tokens_per_image, "k0", px[0])]
    assert encode_with_cache(enc, cache, again, batch_size=8) == 0 and torch.equal(again[0].embeds, items[0].embeds)
    encode_with_cache(enc, cache, items[2:], batch_size=8)
    assert len(cache) == 2 and cache.get("k1") is None  # k0 was used last, so k1 went


def test_chunked_prefill_over_an_image_gives_the_whole_prompt_logits() -> None:
    model = HybridModel(HybridConfig.preset("tiny"))
    tok = ByteTokenizer()
    ids, offsets = chat_prompt(tok, [("user", ["look at ", 0, " now"])], CFG.tokens_per_image)
    emb = Encoder(CFG).encode(_pixels(2))[0]
    mm = MMInput([ImageItem(offsets[0], CFG.tokens_per_image, "k", None, emb)])
    whole_cache = model.new_cache(1)
    whole = model.forward_chunks([SeqChunk(0, ids, 0, mm.chunk_embeds(0, len(ids)))], whole_cache)
    cache = model.new_cache(1)
    pos = 0
    for size in (20, 1, 30, 7, len(ids)):  # pieces that start and end inside the image's tokens
        n = min(size, len(ids) - pos)
        last = model.forward_chunks([SeqChunk(0, ids[pos : pos + n], pos, mm.chunk_embeds(pos, n))], cache)
        pos += n
        if pos == len(ids):
            break
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)
    plain = model.forward_chunks([SeqChunk(0, ids, 0)], model.new_cache(1))
    assert not torch.allclose(plain, whole)  # the embeddings, not the placeholder's, reached the model
