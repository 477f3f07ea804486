"""Inline encode: the monolithic engine encodes a request's images on its own thread,
at admission, before the step's forward passes.

Every request of that step (decodes and text prefills too) waits for the encoder, and
requests that arrive meanwhile wait in the queue: the cost ``--disagg epd`` moves onto
encode workers.  The span ``encode`` (category ``encode``) marks it on the engine
thread; each image request's ``encode_queue_time`` is arrival -> encode start.
"""

from __future__ import annotations

import time
from typing import Any

from infra_agent import tracing
from refstack.encode.encoder import Encoder, EncoderConfig
from refstack.encode.mm import EncoderCache, encode_with_cache


class InlineEncoder:
    def __init__(self, config: Any, model_config: Any) -> None:
        self.encoder = Encoder(EncoderConfig.for_model(config.preset, model_config.hidden_size, config.seed))
        self.cache = EncoderCache(config.encode_cache_size)
        self.batch_size = config.encode_batch_size

    def encode(self, requests: list[Any]) -> None:
        """Fill the embeddings of these requests' images (``Request.mm``) not yet encoded."""
        todo = [r for r in requests if not r.mm.encoded]
        if not todo:
            return
        items = [it for r in todo for it in r.mm.items if it.embeds is None]
        start = time.monotonic()
        with tracing.span("encode", cat="encode", images=len(items), requests=len(todo)) as sp:
            encoded = encode_with_cache(self.encoder, self.cache, items, self.batch_size)
            if sp.args is not None:
                sp.args["encoded"] = encoded
        end = time.monotonic()
        for r in todo:
            r.mm.queue_s = max(0.0, start - r.arrival)
            r.mm.encode_s = end - start
            r.mm.transfer_s = 0.0
