"""The native decode step's spans, recorded as one record of integers per step, with the
per-layer times taken by the C kernels themselves.

The native path (``refstack.model.native_decode``) runs a layer as a few C calls, and
its spans are the module path's: the mixer (``kda`` or ``attention``), then
``moe.dispatch`` with ``ep.dispatch`` inside it, ``moe.experts``, and ``moe.combine``
with ``ep.combine`` inside it; around the layers, ``model.forward`` and ``lm_head``.

What it costs decides how they are taken.  On ``tiny`` (a ~0.3 ms step, 4 layers) six
``span`` objects per layer cost ~12% of the step; ten Python clock reads and one packed
record per layer still cost ~3% (docs/performance.md, "Tracing overhead").  So the
kernels that bound the per-layer spans (the mixer block, ``ep_dispatch``, the experts,
``ep_combine``) write their own entry and exit times into a per-thread log of marks
(``MARK_SPAN`` in ``cpu_common.h``), eight marks a layer, and the step's Python only
resets the log, reads the clock four times and hands ``tracing.int_sink`` the whole
record.  The events and their args are built only when the trace is read.

Where the per-layer spans start and end, from the marks:

- the mixer, ``ep.dispatch``, ``moe.experts`` and ``ep.combine``: their kernel's entry
  and exit (the call's own Python and ctypes overhead is outside them, inside
  ``model.forward``);
- ``moe.dispatch``: from ``ep_dispatch``'s entry to the experts' entry, and
  ``moe.combine``: from the experts' exit to ``ep_combine``'s exit; so the MoE block's
  three phases follow each other, and each exchange sits inside its phase, as on the
  module path.

The record, after the layout id: which categories were recorded (``MASK`` bits), the
batch, the LM head's precision (an index into ``LM_HEAD_PRECISIONS``), whether the
exchange held the GIL, the step's start, the LM head's start and end (-1 when it did not
run), the step's end; per layer whether it is KDA, then per layer the bytes the exchange
moved; then the log: the marks written, their capacity, the marks.  A layer whose kernel
raised records nothing, and neither do the layers after it (the step fails; the layers
before it keep theirs); ``model.forward`` and ``lm_head`` are recorded even then, as the
module path's spans are.
"""

from __future__ import annotations

import array
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from infra_agent import tracing
from refstack.model.config import LM_HEAD_PRECISIONS

MASK = {"kda": 1, "attn": 2, "moe": 4, "ep": 8, "model": 16, "lm_head": 32}
MARKS_PER_LAYER = 8  # mixer, ep_dispatch, experts, ep_combine: entry and exit each
HEADER = 8  # mask, batch, precision, held, t0, h0, h1, t1
# The record's header fields, as indices into the array (after the layout id at 0).
MASK_AT, BATCH_AT, PRECISION_AT, HELD_AT, T0_AT, H0_AT, H1_AT, T1_AT = range(1, HEADER + 1)

Event = tuple[str, str, int, int, "dict[str, Any] | None"]


def begin(lib: Any, kinds: tuple[bool, ...], batch: int, precision: int, held: bool,
          log: bool = True) -> tuple[StepRecord, Callable[[Any], None]] | None:
    """This thread's record for a native step of a model of ``kinds``, its header filled
    in and its mark log emptied and pointed to by the kernels (``log`` false: no marks,
    so it holds no layer), and the sink to hand it to when the step ends; None, with the
    kernels' marking stopped, when none of ``MASK``'s categories is recorded now (tracing
    off, or the ``step`` level).  One call a step: at ~0.3 ms a step every call and
    lookup here shows."""
    tracer = tracing.get_tracer()
    mask, first = _mask(tracer.skip_cats) if tracer.enabled else (0, "")
    sink = tracer.int_sink(first) if mask else None
    if sink is None:
        stop_marks(lib)
        return None
    records: dict[tuple[bool, ...], StepRecord] | None = getattr(_local, "records", None)
    if records is None:
        records = _local.records = {}
        _local.logging = None
    rec = records.get(kinds)
    if rec is None:
        rec = records[kinds] = StepRecord(kinds)
    if not log:
        stop_marks(lib)
    elif _local.logging is not rec:
        lib.refstack_mark_log_set(rec.log_address)
        _local.logging = rec
    v = rec.values
    v[MASK_AT], v[BATCH_AT], v[PRECISION_AT], v[HELD_AT], v[H0_AT], v[H1_AT] = mask, batch, precision, held, -1, -1
    v[rec.log_at] = 0
    if rec.crossed:  # the last step's exchange bytes (an EP setting may have changed since)
        v[rec.cross_at : rec.log_at] = array.array("q", bytes(8 * len(kinds)))
        rec.crossed = False
    return rec, sink


@functools.lru_cache(maxsize=8)
def _mask(skip_cats: frozenset[str]) -> tuple[int, str]:
    """The MASK bits of the categories a level records, and one of them (asked every traced
    step: cached per level's skip set)."""
    mask, first = 0, ""
    for cat, bit in MASK.items():
        if cat not in skip_cats:
            mask |= bit
            first = first or cat
    return mask, first


def marks_in_sync_with_perf_counter() -> bool:
    """Whether the kernels' clock (CLOCK_MONOTONIC) is the one ``time.perf_counter_ns``
    reads, as on Linux; elsewhere the marks would not line up with the other spans."""
    return time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"


class StepRecord:
    """One thread's record of native decode steps for a model of ``kinds`` (per layer:
    whether it is KDA), reused step after step: its tail is the kernels' mark log."""

    def __init__(self, kinds: tuple[bool, ...]) -> None:
        n = len(kinds)
        layout = step_layout(n)
        self.cross_at = 1 + HEADER + n  # first layer's exchange bytes
        self.log_at = self.cross_at + n  # the mark log: count, capacity, marks
        self.values = array.array("q", [0] * (1 + layout.width))
        self.values[0] = layout.id
        self.values[1 + HEADER : self.cross_at] = array.array("q", map(int, kinds))
        self.values[self.log_at + 1] = MARKS_PER_LAYER * n
        self.log_address = self.values.buffer_info()[0] + 8 * self.log_at
        self.crossed = False  # whether an exchange's bytes were written since begin

    def set_cross(self, layer: int, nbytes: int) -> None:
        self.values[self.cross_at + layer] = nbytes
        self.crossed = True

    def drop_layers_from(self, index: int) -> None:
        """Layer ``index`` failed: keep only the marks of the layers before it."""
        self.values[self.log_at] = min(self.values[self.log_at], MARKS_PER_LAYER * index)


# Per thread: the records by layer kinds, and the one whose log the kernels write to.
# Module level and never freed while the thread lives: the C side keeps a raw pointer
# into a record's array, which must outlive any decoder that used it.
_local = threading.local()


def stop_marks(lib: Any) -> None:
    """Stop the kernels marking on this thread (an untraced step after traced ones)."""
    if getattr(_local, "logging", None) is not None:
        lib.refstack_mark_log_set(None)
        _local.logging = None


@functools.cache
def step_layout(n_layers: int) -> tracing.RecordLayout:
    """The step record's layout for a model of ``n_layers`` (registered on its first
    traced step)."""
    return tracing.register_layout(HEADER + 2 * n_layers + 2 + MARKS_PER_LAYER * n_layers, expand_step)


def expand_step(v: Sequence[int]) -> list[Event]:
    """A native step's events: each finished layer's, in the order the layer finished
    them, then ``lm_head`` (when it ran) and ``model.forward``, with the module path's args."""
    mask, B, precision, held, t0, h0, h1, t1 = v[:HEADER]
    n = (len(v) - HEADER - 2) // (2 + MARKS_PER_LAYER)
    kinds, cross = v[HEADER : HEADER + n], v[HEADER + n : HEADER + 2 * n]
    written = min(v[HEADER + 2 * n], MARKS_PER_LAYER * n)
    marks = v[HEADER + 2 * n + 2 :]
    gil = "held" if held else "released"
    events: list[Event] = []
    for layer in range(written // MARKS_PER_LAYER):
        m0, m1, ed0, ed1, x0, x1, ec0, ec1 = marks[MARKS_PER_LAYER * layer : MARKS_PER_LAYER * (layer + 1)]
        if kinds[layer] and mask & MASK["kda"]:
            events.append(("kda", "kda", m0, m1, {"layer": layer, "tokens": B}))
        elif not kinds[layer] and mask & MASK["attn"]:
            events.append(("attention", "attn", m0, m1, {"layer": layer, "tokens": B}))
        if mask & MASK["ep"]:
            events.append(("ep.dispatch", "ep", ed0, ed1, {"tokens": B, "bytes": cross[layer], "gil": gil}))
        if mask & MASK["moe"]:
            events.append(("moe.dispatch", "moe", ed0, x0, {"tokens": B}))
            events.append(("moe.experts", "moe", x0, x1, {"layer": layer, "tokens": B}))
        if mask & MASK["ep"]:
            events.append(("ep.combine", "ep", ec0, ec1, {"tokens": B, "bytes": cross[layer], "gil": gil}))
        if mask & MASK["moe"]:
            events.append(("moe.combine", "moe", x1, ec1, {"tokens": B}))
    if mask & MASK["lm_head"] and h1 >= 0:
        events.append(("lm_head", "lm_head", h0, h1, {"tokens": B, "precision": LM_HEAD_PRECISIONS[precision]}))
    if mask & MASK["model"]:
        events.append(("model.forward", "model", t0, t1, {"num_chunks": B, "tokens": B}))
    return events
