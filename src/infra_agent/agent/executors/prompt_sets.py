"""The prompt sets a run's serving windows draw: a new one for every window of the run.

``serving/prompt_sets.py`` turns an index into prompts; this hands out the indices.
Each job that runs serving windows (an A/B, the baseline's repeats) gets a block of
them, reserved before it starts, so its windows never draw a set an earlier job drew:
not an earlier pair, not an earlier batch of the same experiment (an extra batch, a
reopened experiment, the confirmation), nor another experiment's.  A server that keeps
answers across processes (on disk) then has nothing to replay either.  The run's next
free index is kept in a file in the run's jobs folder, so a resumed run goes on from it.

Inside a job's block, the windows of slot ``s`` (an A/B pair, or a repeat) at attempt
``a`` (a window measured under foreign load runs again, ``worker.py``) start at
``first + (a * slots + s) * per_slot``: both sides of a pair share their set (pairing
cancels the prompt mix), a re-run gets a new one (its server saw the discarded
window's prompts), and a job without re-runs uses the front of its block only, which
it gives back (``settle``).  ``per_slot`` is the windows one probe run sends (its
``repeats``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Re-runs of a slot measured under foreign load, at most (worker.py): the block holds them.
MAX_RERUNS = 2
_FILE = "prompt-sets"


def windows_per_run(config: dict[str, Any]) -> int:
    """Windows one probe run sends a side: its ``repeats`` (the serving and timeline probes' key)."""
    value = config.get("repeats")
    return value if isinstance(value, int) and value > 1 else 1


def block_size(slots: int, per_slot: int) -> int:
    """Indices a job of ``slots`` slots, each ``per_slot`` windows a side, may draw."""
    return max(1, slots) * max(1, per_slot) * (MAX_RERUNS + 1)


def slot_set(first: int, slots: int, per_slot: int, slot: int, attempt: int) -> int:
    """The prompt set of the first window of ``slot`` at ``attempt`` (0: the first try)."""
    return first + (attempt * slots + slot) * max(1, per_slot)


class PromptSetCounter:
    """The run's next free prompt set, kept in ``<jobs_dir>/prompt-sets``."""

    def __init__(self, jobs_dir: Path) -> None:
        self.path = jobs_dir / _FILE
        self._next: int | None = None
        self._lock = threading.Lock()  # the Ray executor may submit experiments from threads

    def _load(self) -> int:
        if self._next is None:
            try:
                self._next = int(self.path.read_text().strip() or 0)
            except (OSError, ValueError):
                self._next = 0  # no file yet (a new run), or one cut short: the sets start at 0
        return self._next

    def _store(self, value: int) -> None:
        self._next = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{value}\n")
        tmp.replace(self.path)

    def reserve(self, size: int) -> int:
        """The first index of a block of ``size``; written before the job runs, so a killed
        run's resume never hands the block out again."""
        with self._lock:
            first = self._load()
            self._store(first + size)
            return first

    def settle(self, first: int, size: int, used: int | None) -> None:
        """Give back the tail of the block that the job did not draw (``used`` of ``size``;
        None: unknown, the job failed before saying, so the whole block stays taken)."""
        with self._lock:
            if used is not None and 0 <= used < size and self._load() == first + size:
                self._store(first + used)

    def run_block(self, windows: tuple[int, int], run: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
        """``run(first)``: a job of ``windows`` (slots, windows a slot sends a side) on a block
        of its own; the block's tail the job did not draw (``prompt_sets_used``) is given back."""
        size = block_size(*windows)
        first = self.reserve(size)
        out = run(first)
        used = out.get("prompt_sets_used")
        self.settle(first, size, used if isinstance(used, int) else None)
        return out


class GivenBlock(PromptSetCounter):
    """A block reserved elsewhere: a Ray task's, by the driver, which keeps the run's count."""

    def __init__(self, first: int) -> None:  # no file and no lock: the count is the driver's
        self.first = first

    def reserve(self, size: int) -> int:
        return self.first

    def settle(self, first: int, size: int, used: int | None) -> None:
        return None
