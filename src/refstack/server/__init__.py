"""refstack's OpenAI-compatible HTTP server.

    app = create_app(EngineConfig(preset="tiny"))   # builds the model; starts nothing
    uvicorn.run(app, ...)                           # the lifespan starts the engine thread
"""

from __future__ import annotations

from refstack.server.app import create_app

__all__ = ["create_app"]
