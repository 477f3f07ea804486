"""Image embeddings through the KV store, from an encode worker to the prefill worker.

An encode worker puts each image's embeddings as one page under ``{request}/img{k}``
and seals it; the prefill worker's message thread fetches them (``GET``, which also
frees them in the store) before it queues the request, so the engine thread never
waits on the store.  The page is the fp32 rows, ``[tokens, hidden]``, as bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infra_agent import tracing
from refstack.disagg.kvstore import KVStoreClient
from refstack.encode.mm import ImageItem, MMInput

# (prompt offset, tokens, store key, content hash) per image of a request, in prompt order.
ImageMeta = tuple[int, int, str, str]


def image_key(rid: str, k: int) -> str:
    return f"{rid}/img{k}"


def put_embeddings(client: KVStoreClient, key: str, embeds: torch.Tensor) -> int:
    """Put one image's rows under ``key`` and seal it; the bytes sent."""
    payload = embeds.detach().to(torch.float32).contiguous().numpy().tobytes()
    client.put(key, payload)
    client.seal(key)
    return len(payload)


class EmbeddingFetcher:
    """The prefill side: one store connection, used by one thread (the worker's message loop)."""

    def __init__(self, store_path: str) -> None:
        self.store_path = store_path
        self._client: KVStoreClient | None = None

    def fetch(self, rid: str, meta: Sequence[ImageMeta]) -> MMInput:
        if self._client is None:
            self._client = KVStoreClient(self.store_path)
        items = []
        with tracing.span("encode.fetch", cat="encode", request_id=rid, images=len(meta)):
            for offset, n, key, content in meta:
                pages = self._client.get(key)
                if pages is None or len(pages) != 1:
                    raise RuntimeError(f"the KV store has no embeddings sealed for {key}")
                emb = torch.frombuffer(bytearray(pages[0]), dtype=torch.float32).reshape(n, -1)
                items.append(ImageItem(offset, n, content, None, emb))
        return MMInput(items)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
