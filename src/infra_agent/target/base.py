"""What a benchmark needs from a running target, whichever kind it is."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class RunningTarget(Protocol):
    """A reachable OpenAI-compatible server: launched by us or already running."""

    @property
    def url(self) -> str:
        """Base URL without ``/v1`` (requests go to ``{url}/v1/completions``)."""
        ...

    @property
    def metrics_url(self) -> str | None: ...

    @property
    def model(self) -> str | None: ...

    @property
    def log_path(self) -> Path | None: ...

    @property
    def pid(self) -> int | None: ...

    def check_alive(self) -> None:
        """Raise ``TargetError`` (``ServerStartError`` for launched servers) if it is gone."""
        ...

    def log_tail(self, n: int = 40) -> str: ...
