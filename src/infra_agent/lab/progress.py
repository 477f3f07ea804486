"""Progress of a kernel-lab run, on stderr.

On a terminal, a live bar per spec (rich).  Elsewhere -- CI, a log file, a pipe -- a
plain line every ``PLAIN_INTERVAL_S`` seconds, so a long check is never silent:

    kernel check: spec tp_lm_head, 12/40 calls, 33 s

A line is printed from a timer thread, so it also appears while one slow call runs.
A run shorter than the interval prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

# Seconds between plain progress lines when stderr is not a terminal.
PLAIN_INTERVAL_S = 10.0


class LabProgress:
    """A progress callback for ``run_lab`` / ``check_spec`` (a context manager).

    ``progress(spec, done, total, unit)`` records the state; the display is a rich bar
    when ``console`` is a terminal, else plain lines on ``stream`` (stderr by default).
    """

    def __init__(
        self,
        mode: str,
        *,
        console: Console | None = None,
        interval_s: float | None = None,
        enabled: bool = True,
        stream: IO[str] | None = None,
    ) -> None:
        self.mode = mode
        self.enabled = enabled
        self.interval_s = PLAIN_INTERVAL_S if interval_s is None else interval_s
        self._console = console
        self._stream = stream
        self._lock = threading.Lock()
        self._state: tuple[str, int, int, str] | None = None
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar: Progress | None = None
        self._tasks: dict[tuple[str, str], Any] = {}

    def __enter__(self) -> LabProgress:
        self._start = time.monotonic()
        if not self.enabled:
            return self
        console = self._console if self._console is not None else Console(stderr=True)
        if self._stream is None and console.is_terminal:
            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=console, transient=True,
            )
            self._bar.start()
        else:
            self._thread = threading.Thread(target=self._tick, name="kernel-lab-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.stop()

    def __call__(self, spec: str, done: int, total: int, unit: str = "calls") -> None:
        with self._lock:
            self._state = (spec, done, total, unit)
        if self._bar is not None:
            key = (spec, unit)
            if key not in self._tasks:
                self._tasks[key] = self._bar.add_task(f"kernel {self.mode}: {spec} ({unit})", total=total)
            self._bar.update(self._tasks[key], completed=done, total=total)

    def line(self) -> str:
        """The plain progress line for the current state."""
        elapsed = time.monotonic() - self._start
        with self._lock:
            state = self._state
        if state is None:
            return f"kernel {self.mode}: starting, {elapsed:.0f} s"
        spec, done, total, unit = state
        return f"kernel {self.mode}: spec {spec}, {done}/{total} {unit}, {elapsed:.0f} s"

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            stream = self._stream if self._stream is not None else sys.stderr
            try:
                stream.write(self.line() + "\n")
                stream.flush()
            except (OSError, ValueError):  # stderr closed: progress is not worth a crash
                return
