"""A request's images: where their placeholder tokens sit in the prompt, and their
embeddings once encoded.  ``chat_prompt`` builds the prompt ids of a chat whose
messages hold content parts.

The placeholder is token ``IMAGE_TOKEN_ID`` (``<|image|>``, the first id the byte
tokenizer leaves unused): an image takes ``tokens_per_image`` of them in a row, and the
model's embedding of each is replaced by one row of the image's encoder output
(``HybridModel``, through ``SeqChunk.embeds``).  The id is never sampled (the engine
masks every unused id).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

IMAGE_TOKEN_ID = 261
IMAGE_TOKEN = "<|image|>"


@dataclass(slots=True)
class ImageItem:
    offset: int  # the prompt position of its first placeholder
    num_tokens: int
    key: str  # the content hash (the encoder cache's key)
    pixels: np.ndarray | None  # uint8 [S, S, 3]; None once it travels as embeddings only
    embeds: Tensor | None = None  # [num_tokens, hidden] once encoded


@dataclass(slots=True)
class MMInput:
    """The images of one request, in prompt order."""

    items: list[ImageItem] = field(default_factory=list)
    # The encode phase (seconds): arrival -> encode start, encoding, embeddings to prefill.
    queue_s: float = 0.0
    encode_s: float = 0.0
    transfer_s: float = 0.0

    def phase_times(self) -> dict[str, float]:
        """``RequestStats``' encode fields."""
        return {"encode_queue_time": self.queue_s, "encode_time": self.encode_s,
                "encode_transfer_time": self.transfer_s}

    @property
    def encoded(self) -> bool:
        return all(it.embeds is not None for it in self.items)

    def chunk_embeds(self, start: int, n: int) -> tuple[Tensor, Tensor] | None:
        """For prompt positions ``[start, start + n)``: (offsets in the chunk, embedding rows)
        of the image tokens among them, or None when the chunk holds none."""
        offsets: list[Tensor] = []
        rows: list[Tensor] = []
        for it in self.items:
            lo, hi = max(start, it.offset), min(start + n, it.offset + it.num_tokens)
            if lo >= hi:
                continue
            assert it.embeds is not None, f"image {it.key[:12]} reached the model before it was encoded"
            offsets.append(torch.arange(lo - start, hi - start))
            rows.append(it.embeds[lo - it.offset : hi - it.offset])
        if not rows:
            return None
        return torch.cat(offsets), torch.cat(rows)


class EncoderCache:
    """Embeddings by image key, least recently used first out; ``capacity`` images (0: off)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value: Tensor) -> None:
        if self.capacity <= 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def encode_with_cache(encoder: Any, cache: EncoderCache, items: Sequence[ImageItem], batch_size: int) -> int:
    """Fill every item's ``embeds``: from the cache, else encoded in batches of at most
    ``batch_size`` images; returns how many were encoded."""
    todo: dict[str, list[ImageItem]] = {}
    for it in items:
        hit = cache.get(it.key)
        if hit is not None:
            it.embeds = hit
        else:
            todo.setdefault(it.key, []).append(it)  # one picture twice in a batch is encoded once
    keys = list(todo)
    for i in range(0, len(keys), max(1, batch_size)):
        part = keys[i : i + batch_size]
        pixels = np.stack([todo[k][0].pixels for k in part])  # type: ignore[misc]
        out = encoder.encode(pixels)
        for j, k in enumerate(part):
            emb = out[j].clone()
            cache.put(k, emb)
            for it in todo[k]:
                it.embeds = emb
    return len(keys)


def chat_prompt(tok: Any, messages: Sequence[tuple[str, Sequence[Any]]], tokens_per_image: int) -> tuple[list[int], list[int]]:
    """Prompt ids of a chat whose contents are parts (str for text, int for the image's
    index), with the byte tokenizer's template; and each image's placeholder offset.

    Text-only, the ids equal ``tok.apply_chat_template`` (tested)."""
    ids = [tok.bos_id]
    offsets: list[int] = []
    for role, parts in messages:
        ids.append(tok.im_start_id)
        ids += tok.encode(f"{role}\n")
        for part in parts:
            if isinstance(part, str):
                ids += tok.encode(part)
            else:
                offsets.append(len(ids))
                ids += [IMAGE_TOKEN_ID] * tokens_per_image
        ids.append(tok.im_end_id)
        ids += tok.encode("\n")
    ids.append(tok.im_start_id)
    ids += tok.encode("assistant\n")
    return ids, offsets
