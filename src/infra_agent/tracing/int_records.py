"""Records of integers: spans a hot loop records as one packed record, expanded into
events only when the trace is read (``tracing.int_sink``; the recorder keeps the
per-thread buffers, this module the layouts and the reading).

A layout is registered once; each record is its id and ``width`` signed 64-bit
integers, packed with ``struct`` (whole or not at all), and its expander turns the
integers back into events: (name, cat, start_ns, end_ns or -1, args or None) each.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

# A layout's expander: one record's integers (its id left out) -> the events it stands for.
Expander = Callable[[Sequence[int]], Iterable[tuple[str, str, int, int, "dict[str, Any] | None"]]]
_LAYOUTS: list[tuple[int, Expander]] = []  # index = layout id: (width, expander)


class RecordLayout(NamedTuple):
    """A registered record layout: ``sink(layout.pack(layout.id, v1, ..., v_width))``."""

    id: int
    width: int
    # struct.Struct.pack for the id and ``width`` signed 64-bit integers (native order):
    # a record is packed whole or not at all (a bad value raises before anything is kept).
    pack: Callable[..., bytes]


_LOCK = threading.Lock()


def register_layout(width: int, expand: Expander) -> RecordLayout:
    """A record layout for ``int_sink``: each record is the layout's id and ``width``
    integers, packed with ``layout.pack``; ``expand`` turns one record's integers (without
    the id) into its events when the trace is read.  Register once per layout (e.g. behind
    ``functools.cache``)."""
    if width < 1:
        raise ValueError(f"a record layout needs at least one integer, got width {width}")
    with _LOCK:
        _LAYOUTS.append((width, expand))
        return RecordLayout(len(_LAYOUTS) - 1, width, struct.Struct(f"={width + 1}q").pack)


def expand_records(ints: Sequence[int]) -> tuple[list[tuple[str, str, int, int, dict[str, Any] | None]], int]:
    """The events of a buffer's integer records, and how many records could not be read.

    A record packed by its layout is whole, but a sink handed other bytes (a record of
    another width, an unknown layout id) leaves the rest of the buffer unaligned.  The
    records before it are kept; the rest counts as one dropped event (how many records it
    held cannot be known) and a warning names its offset, so one bad record never makes
    the trace unreadable (``GET /debug/trace``, the dump at exit)."""
    events: list[tuple[str, str, int, int, dict[str, Any] | None]] = []
    i, n = 0, len(ints)
    while i < n:
        layout_id = ints[i]
        if not 0 <= layout_id < len(_LAYOUTS) or i + 1 + _LAYOUTS[layout_id][0] > n:
            break
        width, expand = _LAYOUTS[layout_id]
        try:
            got = list(expand(ints[i + 1 : i + 1 + width]))
        except Exception:  # noqa: BLE001 - an expander's bug or a misaligned record: stop here
            break
        # Timestamps are clock readings, positive, and an interval ends after it starts:
        # a record read out of alignment almost never passes this.
        if not all(ev[2] > 0 and (ev[3] == -1 or ev[3] >= ev[2]) for ev in got):
            break
        events += got
        i += 1 + width
    else:
        return events, 0
    log.warning("trace: %d integer values from offset %d could not be read as records (a bad record); "
                "they are counted as dropped", n - i, i)
    return events, 1
