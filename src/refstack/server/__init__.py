"""refstack's OpenAI-compatible HTTP server.

    app = create_app(EngineConfig(preset="tiny"))   # builds the model; starts nothing
    uvicorn.run(app, ...)                           # the lifespan starts the engine thread

``create_app`` is imported on first use, so ``refstack.server.logprobs`` (the engine
the disaggregated workers run) loads without the web stack.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from refstack.server.app import create_app

        return create_app
    raise AttributeError(f"module 'refstack.server' has no attribute {name!r}")
