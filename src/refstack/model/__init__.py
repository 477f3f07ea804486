"""The refstack model: a hybrid KDA / GQA-attention MoE LLM with seeded random weights.

    from refstack.model import HybridConfig, HybridModel, ByteTokenizer, SeqChunk

    model = HybridModel(HybridConfig.preset("tiny"))
    cache = model.new_cache(num_slots=8)
    logits = model.forward_chunks([SeqChunk(slot=0, token_ids=[1, 2, 3], start_pos=0)], cache)
"""

from __future__ import annotations

from refstack.model.batch import ForwardBatch, SeqChunk
from refstack.model.cache import ModelCache
from refstack.model.config import HybridConfig
from refstack.model.kda_ops import kda_chunked, kda_naive, kda_recurrent_step
from refstack.model.model import HybridModel
from refstack.model.moe import combine, dispatch, route
from refstack.model.tokenizer import ByteTokenizer, StreamDecoder

__all__ = [
    "ByteTokenizer",
    "ForwardBatch",
    "HybridConfig",
    "HybridModel",
    "ModelCache",
    "SeqChunk",
    "StreamDecoder",
    "combine",
    "dispatch",
    "kda_chunked",
    "kda_naive",
    "kda_recurrent_step",
    "route",
]
