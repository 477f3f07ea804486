"""The native decode step's spans, recorded as one record of integers per layer and one
per step.

The native path (``refstack.model.native_decode``) runs a layer as a few C calls, and
its spans are the module path's: the mixer (``kda`` or ``attention``), then
``moe.dispatch`` with ``ep.dispatch`` inside it, ``moe.experts``, and ``moe.combine``
with ``ep.combine`` inside it.  On ``tiny`` (a ~0.3 ms step, 4 layers) six ``span``
objects per layer cost ~12% of the step at the ``layer`` level.  The step reads the
clock at each boundary instead and hands ``tracing.int_sink`` one packed record per
layer; the events and their args are built only when the trace is read
(docs/performance.md, "Tracing overhead").

A record, after the layout id: which categories were recorded (``MASK`` bits), the
layer's index, whether it is a KDA layer, the batch, the bytes the expert-parallel
exchange moved, whether it held the GIL, then the start and end of: the mixer,
``moe.dispatch``, ``ep.dispatch``, ``moe.experts``, ``moe.combine``, ``ep.combine``.
A layer whose kernel raised records nothing (the step fails; the layers before it
keep theirs).

The step's own record (``step_layout``) carries ``model.forward`` and ``lm_head``, which
the module path opens as ``span`` objects: the mask, the batch, the LM head's precision
(an index into ``LM_HEAD_PRECISIONS``), the step's start, the LM head's start and end
(-1 when it did not run), the step's end.  It is recorded even when a kernel raised, as
the module path's spans are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from infra_agent import tracing
from refstack.model.config import LM_HEAD_PRECISIONS

MASK = {"kda": 1, "attn": 2, "moe": 4, "ep": 8, "model": 16, "lm_head": 32}
LAYER_BITS = MASK["kda"] | MASK["attn"] | MASK["moe"] | MASK["ep"]  # what a layer record can hold
WIDTH = 18
STEP_WIDTH = 7


def sink() -> tuple[int, Callable[[bytes], None] | None]:
    """This step's category mask and the sink its records go to; (0, None) when none of
    ``MASK``'s categories is recorded now (tracing off, or the ``step`` level)."""
    tracer = tracing.get_tracer()
    if not tracer.enabled:
        return 0, None
    mask = _mask(tracer.skip_cats)
    if not mask:
        return 0, None
    return mask, tracer.int_sink(next(cat for cat, bit in MASK.items() if mask & bit))


@functools.lru_cache(maxsize=8)
def _mask(skip_cats: frozenset[str]) -> int:
    """The MASK bits of the categories a level records (asked every traced step: cached
    per level's skip set)."""
    mask = 0
    for cat, bit in MASK.items():
        if cat not in skip_cats:
            mask |= bit
    return mask


@functools.cache
def layout() -> tracing.RecordLayout:
    """The layer record's layout (registered on the first traced step)."""
    return tracing.register_layout(WIDTH, expand)


@functools.cache
def step_layout() -> tracing.RecordLayout:
    """The step record's layout: ``model.forward`` and ``lm_head`` around the layers."""
    return tracing.register_layout(STEP_WIDTH, expand_step)


def expand_step(v: Sequence[int]) -> list[tuple[str, str, int, int, dict[str, Any] | None]]:
    """A native step's ``lm_head`` (when it ran) and ``model.forward``, with the module
    path's args (a decode batch is one chunk per token)."""
    mask, B, precision, t0, h0, h1, t1 = v
    events: list[tuple[str, str, int, int, dict[str, Any] | None]] = []
    if mask & MASK["lm_head"] and h1 >= 0:
        events.append(("lm_head", "lm_head", h0, h1, {"tokens": B, "precision": LM_HEAD_PRECISIONS[precision]}))
    if mask & MASK["model"]:
        events.append(("model.forward", "model", t0, t1, {"num_chunks": B, "tokens": B}))
    return events


def expand(v: Sequence[int]) -> list[tuple[str, str, int, int, dict[str, Any] | None]]:
    """One layer record's events, in the order the layer finished them."""
    mask, layer, is_kda, B, cross, held, m0, m1, d0, d1, ed0, ed1, x0, x1, c0, c1, ec0, ec1 = v
    gil = "held" if held else "released"
    events: list[tuple[str, str, int, int, dict[str, Any] | None]] = []
    if mask & (MASK["kda"] if is_kda else MASK["attn"]):
        events.append(("kda", "kda", m0, m1, {"layer": layer, "tokens": B}) if is_kda
                      else ("attention", "attn", m0, m1, {"layer": layer, "tokens": B}))
    if mask & MASK["ep"]:
        events.append(("ep.dispatch", "ep", ed0, ed1, {"tokens": B, "bytes": cross, "gil": gil}))
    if mask & MASK["moe"]:
        events.append(("moe.dispatch", "moe", d0, d1, {"tokens": B}))
        events.append(("moe.experts", "moe", x0, x1, {"layer": layer, "tokens": B}))
    if mask & MASK["ep"]:
        events.append(("ep.combine", "ep", ec0, ec1, {"tokens": B, "bytes": cross, "gil": gil}))
    if mask & MASK["moe"]:
        events.append(("moe.combine", "moe", c0, c1, {"tokens": B}))
    return events
