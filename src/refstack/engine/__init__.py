"""refstack's serving engine: continuous batching, chunked prefill, cache slots, sampling.

    engine = Engine(EngineConfig(preset="tiny"))
    engine.start()                                   # the "engine-loop" thread
    stream = engine.submit(prompt_ids, SamplingParams(max_tokens=32))   # on an event loop
    async for delta in stream: ...
    engine.stop()

Only the config is imported eagerly: the CLI's `knobs` listing needs it without
paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from refstack.engine.config import EngineConfig

_LAZY = {
    "Engine": "refstack.engine.engine",
    "EngineObserver": "refstack.engine.engine",
    "QueueFullError": "refstack.engine.engine",
    "RequestStream": "refstack.engine.consumers",
    "RequestOutput": "refstack.engine.request",
    "RequestStats": "refstack.engine.request",
    "SamplingParams": "refstack.engine.sampling",
}

__all__ = ["EngineConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'refstack.engine' has no attribute {name!r}")
