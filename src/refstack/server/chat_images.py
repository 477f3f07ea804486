"""Chat requests with content parts: the prompt ids, and the images decoded for the encoder.

A message's content may be a list of parts (``{"type": "text", "text": ...}``,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``).  Text
parts are concatenated; each image becomes ``tokens_per_image`` placeholder tokens
(``refstack.encode.mm``).  A refused image is a 400 whose ``param`` names the part
(``messages.1.content.0.image_url.url``); nothing is queued.  Decoding runs in a
worker thread, so a large image does not stall the server's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from refstack.encode.encoder import EncoderConfig
from refstack.encode.images import ImageError, decode_image
from refstack.encode.mm import ImageItem, MMInput, chat_prompt
from refstack.model.tokenizer import UnencodableTextError
from refstack.server.errors import APIError, bad_request
from refstack.server.protocol import ChatMessage, ImagePart


def encoder_config(engine: Any) -> EncoderConfig:
    cfg = engine.config
    return EncoderConfig.for_model(cfg.preset, engine.model.config.hidden_size, cfg.seed)


def _decode_all(urls: list[tuple[str, str]], size: int) -> list[Any]:
    out = []
    for param, url in urls:
        try:
            out.append(decode_image(url, size))
        except ImageError as exc:
            raise bad_request(f"'{param}': {exc}", param=param, code="invalid_image") from None
    return out


async def chat_with_images(engine: Any, messages: Sequence[ChatMessage]) -> tuple[list[int], MMInput | None]:
    """Prompt ids and the images (None when there are none) of a chat with content parts."""
    enc = encoder_config(engine)
    parts: list[tuple[str, list[Any]]] = []
    urls: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            parts.append((m.role, [m.content]))
            continue
        mine: list[Any] = []
        for j, p in enumerate(m.content):
            if isinstance(p, ImagePart):
                mine.append(len(urls))
                urls.append((f"messages.{i}.content.{j}.image_url.url", p.image_url.url))
            else:
                mine.append(p.text)
        parts.append((m.role, mine))
    unsupported = getattr(engine, "images_unsupported", None)
    if urls and unsupported:
        raise APIError(400, f"images are not supported by this server: {unsupported}", param=urls[0][0],
                       code="unsupported_value")
    decoded = await asyncio.to_thread(_decode_all, urls, enc.image_size) if urls else []
    tok = engine.tokenizer
    try:
        ids, offsets = chat_prompt(tok, parts, enc.tokens_per_image)
    except UnencodableTextError as exc:
        raise bad_request(f"'messages': {exc}", param="messages", code="invalid_value") from None
    if not decoded:
        return ids, None
    items = [ImageItem(off, enc.tokens_per_image, d.key, d.pixels) for off, d in zip(offsets, decoded)]
    return ids, MMInput(items)
