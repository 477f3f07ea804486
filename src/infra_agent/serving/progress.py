"""The live progress display of a benchmark window: a bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from infra_agent.serving.client import RequestRecord

PROGRESS_EVERY_S = 5.0  # plain progress lines (no terminal): at least this often, and every 10%


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class BenchProgress:
    """A rich bar on a terminal; plain lines elsewhere (CI, a log file), where a bar prints nothing.

    Plain lines go out at every tenth of the requests and at least every ``every_s``:
    ``bench: 120/200 requests, 3 failed, 14.2 s``.
    """

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, every_s: float = PROGRESS_EVERY_S) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.mode = "off" if not enabled or total <= 0 else "bar" if _isatty(self.stream) else "lines"
        self._bar: Progress | None = None
        self._task: Any = None
        self._ticker: asyncio.Task[None] | None = None
        self._tenths = 0
        self._t0 = self._last = 0.0

    async def __aenter__(self) -> BenchProgress:
        self._t0 = self._last = time.perf_counter()
        if self.mode == "bar":
            self._bar = Progress(
                TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[failed]} failed"),
                TimeElapsedColumn(), console=Console(file=self.stream), transient=True,
            )
            self._task = self._bar.add_task("requests", total=self.total, failed=0)
            self._bar.start()
        elif self.mode == "lines":
            self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._bar is not None:
            self._bar.stop()

    def advance(self, rec: RequestRecord) -> None:
        self.done += 1
        self.failed += not rec.success
        if self._bar is not None:
            self._bar.update(self._task, advance=1, failed=self.failed)
        elif self.mode == "lines":
            tenths = self.done * 10 // self.total
            if tenths > self._tenths:
                self._tenths = tenths
                self._line()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self._last + self.every_s - time.perf_counter()))
            if time.perf_counter() - self._last >= self.every_s:
                self._line()

    def _line(self) -> None:
        now = time.perf_counter()
        self._last = now
        try:
            self.stream.write(f"bench: {self.done}/{self.total} requests, {self.failed} failed, {now - self._t0:.1f} s\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr must not end the run
