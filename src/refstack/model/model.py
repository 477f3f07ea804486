"""The hybrid model: embedding, KDA / attention layers each followed by an MoE, LM head."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from infra_agent import tracing
from refstack.kernels import cpu_kernels
from refstack.kernels.arena import to_huge_pages
from refstack.model.attention import AttentionLayer, rope_tables
from refstack.model.batch import ForwardBatch, SeqChunk
from refstack.model.cache import ModelCache
from refstack.model.config import HybridConfig
from refstack.model.kda import KDALayer
from refstack.model.layers import Embedding, Linear, LMHead, RMSNorm
from refstack.model.moe import DEFAULT_EP, EPSettings, MoE
from refstack.model.native_decode import NativeDecoder


class DecoderLayer(nn.Module):
    """Pre-norm residual block: a sequence mixer (KDA or attention), then an MoE."""

    def __init__(self, config: HybridConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, config.rms_eps, gen)
        self.mixer: KDALayer | AttentionLayer = (
            AttentionLayer(config, layer, gen) if config.is_full_attention(layer) else KDALayer(config, layer, gen)
        )
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_eps, gen)
        self.moe = MoE(config, layer, gen)

    def forward(self, x: Tensor, batch: ForwardBatch, cache: ModelCache) -> Tensor:
        """The block's output.  On the native path ``x`` itself is updated in place and
        returned: the caller (``forward_chunks``) owns the residual stream."""
        if self.mlp_norm.native:
            # The residual add rides in the norm kernel, and x (this forward's own
            # residual stream) is updated in place: two fewer passes per block.
            delta = self.mixer(self.mixer_norm(x), batch, cache)
            h = cpu_kernels.rms_norm(x, self.mlp_norm.weight, self.mlp_norm.eps, residual_delta=delta)
            return x.add_(self.moe(h))
        x = x + self.mixer(self.mixer_norm(x), batch, cache)
        return x + self.moe(self.mlp_norm(x))


class HybridModel(nn.Module):
    """Built from the config alone: weights are drawn from a generator seeded with ``config.seed``."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        self.embed = Embedding(config.vocab_size, config.hidden_size, gen)
        self.layers = nn.ModuleList(DecoderLayer(config, i, gen) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps, gen)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, config.lm_head_precision, gen)
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.dtype == "bfloat16":
            routers = {id(m.router) for m in self.modules() if isinstance(m, MoE)}
            for module in self.modules():
                if isinstance(module, (Linear, MoE, KDALayer)) and id(module) not in routers:
                    module.round_to_bf16()
        self.native_kernels = False  # see use_native_kernels
        self.ep = DEFAULT_EP  # see configure_ep
        self.native_decoder: NativeDecoder | None = None
        self.eval()

    def use_native_kernels(self, on: bool) -> None:
        """Route the Linears, norms, MoE, KDA recurrence, decode attention and LM head through
        ``refstack.kernels.cpu_kernels`` (``on``), or back to torch.  Packs the weights
        once; raises ``NativeKernelsUnavailable`` when the kernels cannot be built here."""
        if on == self.native_kernels:
            return  # every Engine over a shared model asks again; nothing to repack
        if on and self.device.type != "cpu":
            raise ValueError(f"use_native_kernels: the native kernels take CPU tensors; this model is on {self.device}")
        if on:
            cpu_kernels.load()
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, MoE, KDALayer, AttentionLayer, LMHead)):
                module.use_native(on)
        if on:
            self._packed_to_huge_pages()
        self.native_kernels = on
        # Decode-only steps take one C call per block (see native_decode); it points
        # into the packed weights, so it goes when they do.
        self.native_decoder = NativeDecoder(self) if on else None

    @property
    def device(self) -> torch.device:
        """Where the weights live (``model.to(device)`` moves them; caches and batches follow)."""
        return self.embed.weight.device

    def use_kda_decode_kernel(self, kernel: str) -> None:
        """The KDA layers' decode step: "torch" or "triton" (``refstack.kernels.kda_decode``,
        imported now, so only a model that asks for it imports Triton)."""
        for module in self.modules():
            if isinstance(module, KDALayer):
                module.use_decode_kernel(kernel)

    def configure_ep(self, ep: EPSettings) -> None:
        """The expert-parallel exchange's GIL and link model for every MoE layer (both paths)."""
        self.ep = ep
        for module in self.modules():
            if isinstance(module, MoE):
                module.ep = ep

    def _packed_to_huge_pages(self) -> None:
        """Move every packed weight into one huge-page mapping (see ``kernels.arena``):
        a decode step streams them all, and 2 MiB pages spare it the TLB misses."""
        where: list[tuple[Any, str, int | None]] = []  # (module, attribute, index in a tuple)
        tensors: list[Tensor] = []
        for module in self.modules():
            for attr in ("packed", "low_rank_packed"):
                value = getattr(module, attr, None)
                for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                    if isinstance(t, Tensor):
                        where.append((module, attr, i if isinstance(value, tuple) else None))
                        tensors.append(t)
        moved = to_huge_pages(tensors)
        for (module, attr, index), t in zip(where, moved):
            if index is None:
                setattr(module, attr, t)
            else:
                parts = list(getattr(module, attr))
                parts[index] = t
                setattr(module, attr, tuple(parts))

    def new_cache(self, num_slots: int, max_seq_len: int | None = None, *, kv_dtypes: dict[int, str] | None = None,
                  state_dtype: str = "fp32") -> ModelCache:
        """A cache on the model's device.  ``kv_dtypes``: {attention layer: "fp32" | "bf16" |
        "fp8_e4m3" | "int8"} (others fp32); fp8 / int8 layers take their per-head scales from
        a calibration prefill through this model (``cache.calibrate_kv_amax``, once per model).
        ``state_dtype``: the KDA states' ("fp32" or "bf16")."""
        from refstack.model.cache import calibrate_kv_amax
        from refstack.model.kv_dtypes import SCALED

        scaled = any(d in SCALED for d in (kv_dtypes or {}).values())
        return ModelCache(self.config, num_slots, max_seq_len, device=self.device, kv_dtypes=kv_dtypes,
                          kv_amax=calibrate_kv_amax(self) if scaled else None, state_dtype=state_dtype)

    @torch.inference_mode()
    def forward_chunks(self, chunks: Sequence[SeqChunk], cache: ModelCache) -> Tensor:
        """Run one step over the given chunks; next-token logits ``[len(chunks), vocab]``.

        Each chunk's logits are for the token after its last one.  Chunks of one token
        are decoded together in batched tensor ops; longer chunks are prefilled one
        sequence at a time (chunkwise-parallel inside).
        """
        return self._forward_chunks(chunks, cache, ())[0]

    @torch.inference_mode()
    def forward_chunks_all_positions(self, chunks: Sequence[SeqChunk], cache: ModelCache,
                                     every: Collection[int]) -> tuple[Tensor, dict[int, Tensor]]:
        """``forward_chunks``, plus the logits after *every* position of the chunks in ``every``.

        Returns the next-token logits ``[len(chunks), vocab]`` as ``forward_chunks`` does,
        and for each chunk index ``i`` in ``every`` a tensor ``[len(chunks[i].token_ids),
        vocab]`` whose row ``j`` is the logits for the token after position
        ``start_pos + j`` (its last row is row ``i`` of the first result).  Teacher-forced
        prompt logprobs need them (completions with ``echo``); the cache and state
        updates are the ones ``forward_chunks`` makes, so a prompt may arrive in chunks
        over several steps.  The LM head then runs over those chunks' every row."""
        return self._forward_chunks(chunks, cache, every)

    def _forward_chunks(self, chunks: Sequence[SeqChunk], cache: ModelCache,
                        every: Collection[int]) -> tuple[Tensor, dict[int, Tensor]]:
        batch = ForwardBatch.from_chunks(chunks, cache.num_slots, cache.max_seq_len, device=self.device)
        if self.native_decoder is not None and self.native_decoder.takes(batch):
            # Its model.forward and lm_head spans are in its own step record (decode_trace).
            last = self.native_decoder.forward(batch, cache)
            return last, {i: last[i : i + 1] for i in every}  # one token per chunk: its row is all of it
        with tracing.span("model.forward", cat="model", num_chunks=len(chunks), tokens=batch.num_tokens):
            batch.rope = (self.rope_cos[batch.positions], self.rope_sin[batch.positions])
            x = self.embed(batch.token_ids)
            if batch.embed_rows is not None and batch.embed_values is not None:
                # Image tokens: the encoder's rows replace the placeholder's embedding.
                x = x.index_copy(0, batch.embed_rows.to(x.device), batch.embed_values.to(x.device, x.dtype))
            for layer in self.layers:
                x = layer(x, batch, cache)
            # Only each chunk's last position needs logits: the LM head is the widest matmul.
            h = self.norm(x.index_select(0, batch.last_token_index))
            last = self.lm_head(h)
            if not every:
                return last, {}
            # The other rows of the chunks in ``every`` go through an LM head call of their
            # own, so the rows above (what every request samples from) are computed
            # exactly as without them.
            lasts = batch.last_token_index.tolist()
            rows: list[int] = []
            spans: dict[int, tuple[int, int]] = {}
            for i in sorted(set(every)):
                m = len(chunks[i].token_ids) - 1  # a chunk's tokens are consecutive rows of the stream
                spans[i] = (len(rows), m)
                rows.extend(range(lasts[i] - m, lasts[i]))
            if not rows:
                return last, {i: last[i : i + 1] for i in spans}
            index = torch.tensor(rows, dtype=torch.long).to(batch.last_token_index.device)
            inner = self.lm_head(self.norm(x.index_select(0, index)))
            return last, {i: torch.cat([inner[o : o + m], last[i : i + 1]]) for i, (o, m) in spans.items()}

    def forward(self, chunks: Sequence[SeqChunk], cache: ModelCache) -> Tensor:
        return self.forward_chunks(chunks, cache)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
