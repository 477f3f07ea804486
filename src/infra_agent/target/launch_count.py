"""How many servers this process has launched: a launch is a cost of its own.

An engine that refuses its configuration exits at start-up, before any benchmark ran,
yet its start (minutes for a large model) was spent.  Every process ``ServerProcess``
starts is counted here, a relaunch on a fresh port too.  The experiment worker runs one
job per process, so the count at its end is what the job launched, and the experiment's
cost records it (``Cost.launches``).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_launched = 0


def count_launch() -> None:
    """One more server process started."""
    global _launched
    with _lock:
        _launched += 1


def launches() -> int:
    """Server processes this process has started so far."""
    with _lock:
        return _launched


__all__ = ["count_launch", "launches"]
