"""A small vision encoder with seeded weights: patch embedding, a few pre-norm
transformer blocks, a projection into the language model's hidden size.

Its output for one image is ``tokens_per_image`` rows of ``hidden_size``; the engine
splices them into the prompt at the image's placeholder tokens (``refstack.encode.mm``).
The weights come from one ``torch.Generator`` seeded from the model seed (the global
RNG is never touched), so every process that builds an ``Encoder`` for one config gets
the same weights: the encode workers of ``--disagg epd`` and the monolithic engine
compute the same embeddings.  It runs torch's fp32 ops on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# Added to the model seed so the encoder's draws never repeat the language model's.
SEED_OFFSET = 0x1E7C0DE


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    image_size: int  # images are resized to image_size x image_size before encoding
    patch_size: int
    width: int
    depth: int
    heads: int
    out_dim: int  # the language model's hidden size
    seed: int = 0

    def __post_init__(self) -> None:
        assert self.image_size % self.patch_size == 0, "image_size must be a multiple of patch_size"
        assert self.width % self.heads == 0, "width must be a multiple of heads"

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def for_model(cls, preset: str, hidden_size: int, seed: int) -> EncoderConfig:
        """The encoder served with a preset: ``tiny`` 64 tokens per image, ``small`` 196."""
        if preset == "small":
            return cls(image_size=224, patch_size=16, width=384, depth=6, heads=6, out_dim=hidden_size, seed=seed)
        return cls(image_size=112, patch_size=14, width=192, depth=4, heads=4, out_dim=hidden_size, seed=seed)


def _draw(gen: torch.Generator, *shape: int, std: float) -> Tensor:
    w = torch.empty(*shape, dtype=torch.float32)
    w.normal_(0.0, std, generator=gen)
    return w


class Encoder:
    """``encode(pixels)``: uint8 images ``[B, S, S, 3]`` to embeddings ``[B, tokens, out_dim]``."""

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        c = config
        gen = torch.Generator().manual_seed(c.seed + SEED_OFFSET)
        patch_dim = 3 * c.patch_size * c.patch_size
        self.patch_w = _draw(gen, patch_dim, c.width, std=1 / math.sqrt(patch_dim))
        self.pos = _draw(gen, c.tokens_per_image, c.width, std=0.02)
        std = 1 / math.sqrt(c.width)
        self.blocks = [{
            "qkv": _draw(gen, c.width, 3 * c.width, std=std),
            "o": _draw(gen, c.width, c.width, std=std / math.sqrt(2 * c.depth)),
            "up": _draw(gen, c.width, 4 * c.width, std=std),
            "down": _draw(gen, 4 * c.width, c.width, std=1 / math.sqrt(4 * c.width) / math.sqrt(2 * c.depth)),
        } for _ in range(c.depth)]
        self.proj = _draw(gen, c.width, c.out_dim, std=std)

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    @torch.inference_mode()
    def encode(self, pixels: np.ndarray | Tensor) -> Tensor:
        c = self.config
        x = torch.as_tensor(pixels)
        if x.ndim != 4 or tuple(x.shape[1:]) != (c.image_size, c.image_size, 3):
            raise ValueError(f"Encoder.encode: expected uint8 [B, {c.image_size}, {c.image_size}, 3], got {tuple(x.shape)}")
        b, p, g = x.shape[0], c.patch_size, c.image_size // c.patch_size
        x = x.to(torch.float32) / 255.0 - 0.5
        # [B, S, S, 3] -> [B, g*g, p*p*3]: each patch's pixels, row-major, as one vector.
        x = x.reshape(b, g, p, g, p, 3).permute(0, 1, 3, 2, 4, 5).reshape(b, g * g, p * p * 3)
        h = x @ self.patch_w + self.pos
        hd = c.width // c.heads
        for blk in self.blocks:
            a = F.layer_norm(h, (c.width,))
            q, k, v = (a @ blk["qkv"]).reshape(b, g * g, 3, c.heads, hd).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v)
            h = h + att.transpose(1, 2).reshape(b, g * g, c.width) @ blk["o"]
            h = h + F.gelu(F.layer_norm(h, (c.width,)) @ blk["up"]) @ blk["down"]
        return F.layer_norm(h, (c.width,)) @ self.proj
