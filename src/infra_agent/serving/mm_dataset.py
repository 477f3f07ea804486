"""Multimodal requests: seeded random images in chat prompts, mixed with text-only ones.

Follows vLLM's ``random-mm`` dataset (``vllm bench serve --dataset-name random-mm``):
each request has a random text prompt (``input_len``, ``output_len``, ``range_ratio``
as the random dataset) and a number of images drawn uniformly from
``base_items_per_request * (1 ± num_mm_items_range_ratio)``, capped at
``limit_mm_per_prompt``; each image's size is drawn from ``bucket_config``
(``"HEIGHTxWIDTH": probability``, vLLM's ``{(height, width, 1): probability}``).  The
images are random RGB pixels, sent as PNG ``data:`` URLs in OpenAI content parts.
``text_only_ratio`` of the requests (drawn per request) carry no image: the mixed
load whose text requests an encode stage can hold up.

Everything comes from one ``numpy`` generator seeded with ``seed``: the same spec gives
the same bytes.  The PNGs are written here (zlib, no imaging library), so the benchmark
needs nothing beyond the base install.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import numpy as np

from infra_agent.errors import ConfigError
from infra_agent.serving.client import RequestInput
from infra_agent.serving.datasets import (
    ByteTokenizer,
    Tokenizer,
    random_text,
    sample_lengths,
)


def png_bytes(pixels: np.ndarray) -> bytes:
    """A PNG of uint8 ``[H, W, 3]`` pixels (8-bit RGB, filter 0 on every row)."""
    h, w, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = np.concatenate([np.zeros((h, 1), np.uint8), pixels.reshape(h, w * 3)], axis=1).tobytes()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b""))


def parse_buckets(config: dict[str, float]) -> tuple[list[tuple[int, int]], np.ndarray]:
    """``{"256x256": 0.5, ...}`` -> sizes and normalised probabilities."""
    sizes, probs = [], []
    for key, p in config.items():
        try:
            h, w = (int(x) for x in key.lower().split("x"))
        except ValueError:
            raise ConfigError(None, f"dataset.bucket_config.{key}", "'HEIGHTxWIDTH' (e.g. '256x256')", key) from None
        if h < 1 or w < 1 or p < 0:
            raise ConfigError(None, f"dataset.bucket_config.{key}", "positive sizes and a probability >= 0", (key, p))
        sizes.append((h, w))
        probs.append(float(p))
    total = sum(probs)
    if not sizes or total <= 0:
        raise ConfigError(None, "dataset.bucket_config", "at least one bucket with a positive probability", config)
    return sizes, np.array(probs) / total


def random_mm_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                       base_items_per_request: int = 1, num_mm_items_range_ratio: float = 0.0,
                       limit_mm_per_prompt: int = 255, bucket_config: dict[str, float] | None = None,
                       text_only_ratio: float = 0.0, tokenizer: Tokenizer | None = None) -> list[RequestInput]:
    if not 0.0 <= text_only_ratio <= 1.0:
        raise ConfigError(None, "dataset.text_only_ratio", "a number in [0, 1]", text_only_ratio)
    if not 0.0 <= num_mm_items_range_ratio <= 1.0:
        raise ConfigError(None, "dataset.num_mm_items_range_ratio", "a number in [0, 1]", num_mm_items_range_ratio)
    tok = tokenizer or ByteTokenizer()
    sizes, probs = parse_buckets(bucket_config or {"256x256": 1.0})
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, n, input_len, range_ratio)
    out_lens = sample_lengths(rng, n, output_len, range_ratio)
    lo = max(0, int(np.floor(base_items_per_request * (1 - num_mm_items_range_ratio))))
    hi = int(np.ceil(base_items_per_request * (1 + num_mm_items_range_ratio)))
    reqs = []
    for i in range(n):
        text, actual = random_text(tok, rng, int(in_lens[i]))
        count = 0 if rng.random() < text_only_ratio else min(int(rng.integers(lo, hi + 1)), limit_mm_per_prompt)
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        for _ in range(count):
            h, w = sizes[int(rng.choice(len(sizes), p=probs))]
            png = png_bytes(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        reqs.append(RequestInput(prompt=[{"role": "user", "content": parts}],  # type: ignore[list-item]
                                 prompt_len=actual, output_len=int(out_lens[i]), num_images=count))
    return reqs
