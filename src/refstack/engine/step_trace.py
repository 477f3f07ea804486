"""The engine step's own spans, recorded as one record of integers per step.

A traced step records up to five spans: ``engine.step`` and, inside it, ``schedule``,
``decode`` and/or ``prefill``, and ``sample`` (those that ran), each with the step's shape in its args
(what the timeline's trends regress span durations on).  The step reads the clock at
each phase boundary and, when it ends, hands its ``tracing.int_sink`` one packed
record of integers; the events and their args dicts are built only when the trace is read.
Objects per span (and before that, ``span`` context managers) cost the step-level
trace ~1% of a ~0.3 ms step on ``tiny`` in allocation and retained memory alone
(docs/performance.md, "Tracing overhead").

The phases follow each other with nothing between them, so one clock read ends a phase
and starts the next: a record holds the step's start, then the end of ``schedule``,
``decode``, ``prefill`` and ``sample`` (-1 for a phase that did not run or did not
finish: a failed step keeps what it finished), then the step's end; whether decode and
prefill ran fused; the rows sampled; then the decode chunks' shape and the prefill
chunks' shape (``shape``; the decode shape's batch is -1 when the step failed before
its shape was taken).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from infra_agent import tracing

if TYPE_CHECKING:
    from refstack.engine.scheduler import ScheduledChunk

NO_SHAPE = (-1, 0, 0, 0)  # the step failed before its shape was taken
EMPTY_SHAPE = (0, 0, 0, 0)
WIDTH = 16


def shape(chunks: Sequence[ScheduledChunk]) -> tuple[int, int, int, int]:
    """What a forward's time depends on: ``batch`` (sequences), ``tokens`` (forwarded this
    step), ``context`` (positions attended in total: each chunk's start plus its tokens)
    and ``generated`` (tokens the batch's requests have generated so far)."""
    # One loop, not four generator sums: this runs every traced step.
    tokens = context = generated = 0
    for c in chunks:
        n = len(c.token_ids)
        tokens += n
        context += c.start_pos + n
        generated += len(c.request.output_ids)
    return (len(chunks), tokens, context, generated)


def decode_shape(chunks: Sequence[ScheduledChunk]) -> tuple[int, int, int, int]:
    """``shape`` of decode chunks, which feed one token each (``Request.next_chunk``
    asserts it): one attribute read less per sequence, on the path every traced decode
    step takes."""
    context = generated = 0
    for c in chunks:
        context += c.start_pos
        generated += len(c.request.output_ids)
    n = len(chunks)
    return (n, n, context + n, generated)


@functools.cache
def layout() -> tracing.RecordLayout:
    """The step record's layout (registered on the first traced step)."""
    return tracing.register_layout(WIDTH, expand)


def _args(batch: int, tokens: int, context: int, generated: int) -> dict[str, int]:
    return {"batch": batch, "tokens": tokens, "context": context, "generated": generated}


def expand(v: Sequence[int]) -> list[tuple[str, str, int, int, dict[str, Any] | None]]:
    """One step record's events, in the order the step finished them."""
    (t_step, t_sched, t_decode, t_prefill, t_sample, t_end, fused, n_ready,
     db, dt, dc, dg, pb, pt, pc, pg) = v
    decode = _args(db, dt, dc, dg)
    # The step's shape is its decode and prefill chunks' together.
    step = None if db < 0 else _args(db + pb, dt + pt, dc + pc, dg + pg) if pb else decode
    events: list[tuple[str, str, int, int, dict[str, Any] | None]] = []
    if t_sched >= 0:
        events.append(("schedule", "engine", t_step, t_sched, None))
    if t_decode >= 0:
        events.append(("decode", "engine", t_sched, t_decode, decode))
    forwarded = t_decode if t_decode >= 0 else t_sched  # where the next phase starts
    if t_prefill >= 0:
        # A fused step is a "prefill" step that also carries the decode batch.
        args = {"chunks": pb, "decode_batch": db, "prefill_tokens": pt, **(step or {})} if fused \
            else {"chunks": pb, **_args(pb, pt, pc, pg)}
        events.append(("prefill", "engine", forwarded, t_prefill, args))
        forwarded = t_prefill
    if t_sample >= 0:
        events.append(("sample", "engine", forwarded, t_sample, {"batch": n_ready}))
    events.append(("engine.step", "engine", t_step, t_end, step))
    return events
