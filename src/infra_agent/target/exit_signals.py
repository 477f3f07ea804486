"""Signals that end this process, turned into exceptions while a server runs.

A ``with ServerProcess(...)`` block stops its server on the way out, but only if the way
out runs Python code: by default SIGTERM and SIGHUP end the process at once and orphan
the server's session.  ``ExitSignals`` makes them raise ``Terminated`` (a ``SystemExit``)
instead, so ``with`` blocks unwind and clean up.  It is apart from the server because it
is process-wide state that only the main thread may change.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class Terminated(SystemExit):
    """SIGTERM/SIGHUP turned into an exception, so ``with`` blocks unwind and clean up."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(128 + signum)


class ExitSignals:
    """Handlers installed for the life of one ``with`` block, then the previous ones restored."""

    def __init__(self) -> None:
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        # signal.signal only works on the main thread; elsewhere the owner of the
        # main thread is responsible for turning signals into exceptions.
        if threading.current_thread() is not threading.main_thread():
            return
        # Only default dispositions are replaced: a handler the application installed
        # (or SIG_IGN it chose) stays in charge.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._saved[sig] = signal.signal(sig, _raise_terminated)
        # Python normally maps SIGINT to KeyboardInterrupt already; an embedding host may
        # not, and the default action would kill us and orphan the server's session.
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
            self._saved[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
