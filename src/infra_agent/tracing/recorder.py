"""The span recorder: per-thread buffers, a process-wide tracer, Chrome trace output.

Why a process-wide tracer: spans are emitted from deep inside engine code running on
several threads; threading a tracer object through every call would couple the
engine's signatures to instrumentation.  The tracer holds only configuration and
buffers, never per-step state.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from time import perf_counter_ns
from typing import Any, TypeVar

from infra_agent.tracing.call_site import allocating_site

# Re-exported: the tracing API is reached through this module (and the package).
from infra_agent.tracing.int_records import (  # noqa: F401
    RecordLayout,
    expand_records,
    register_layout,
)

ENV_VAR = "INFRA_AGENT_TRACE"
LEVEL_ENV_VAR = "INFRA_AGENT_TRACE_LEVEL"
# What each level leaves out, by span category.  "layer" (the default) records every
# span; "step" drops the per-layer ones (KDA, attention, MoE, expert-parallel) and the
# two inside a step's ``decode``/``prefill`` that repeat its extent (``model.forward``,
# ``lm_head``): four spans per decode step instead of ~30, for a trace cheap enough to
# leave on in serving (docs/performance.md, bench/tracer_overhead.py).  The step shares
# and trends need only those four; the timeline analysis of the expert-parallel section
# needs "layer".
LEVELS: dict[str, frozenset[str]] = {
    "layer": frozenset(),
    "step": frozenset({"kda", "attn", "moe", "ep", "model", "lm_head"}),
}
# A bound per thread keeps a forgotten trace from eating the machine's memory.
MAX_EVENTS_PER_THREAD = 2_000_000

F = TypeVar("F", bound=Callable[..., Any])


class _ThreadBuffer:
    __slots__ = ("add", "add_ints", "dropped", "flat", "ident", "ints", "name", "tid")

    def __init__(self, tid: int, name: str, ident: int = 0) -> None:
        self.tid = tid
        # threading.get_ident() (the pthread id): py-spy names threads by it, so a
        # sampler's threads can be matched to these spans' (native-id) threads.
        self.ident = ident
        self.name = name
        # Events laid end to end, FIELDS values each: name, cat, start_ns, end_ns (-1 for
        # an instant event), args.  Not a tuple per event: recording a span must leave
        # no object the garbage collector tracks.  A tuple per event stays tracked (for
        # good when it holds the args dict), and a long trace of them triggered full
        # collections that walked the whole heap: a traced engine lost 26% of its
        # throughput (bench/tracer_overhead.py).  The args are the span's keyword dict,
        # which CPython leaves untracked while its values are atomic.  One extend per
        # event keeps a concurrent snapshot whole (list.extend holds the GIL throughout).
        self.flat: list[Any] = []
        self.add = self.flat.extend  # bound once: one lookup less per span
        # Records of a registered layout (register_layout), packed: its id, then its
        # integers, 8 bytes each.  Machine integers, not objects: nothing for the allocator
        # to keep or the collector to walk (int_sink).
        self.ints = bytearray()
        self.add_ints = self.ints.extend
        self.dropped = 0

    def drop(self, record: bytes) -> None:
        """A full buffer's int sink: counts the record it does not keep.  A record counts as
        one dropped event, whatever it expands to (its layout is not looked up here)."""
        self.dropped += 1


FIELDS = 5
MAX_FLAT = MAX_EVENTS_PER_THREAD * FIELDS
# The integer records' own bound, in bytes: ~4 events' worth of values each, as a step
# record (17 values, up to 5 events) holds.  Checked when a sink is handed out, so a
# thread may overshoot it by what it records with one sink (one step).
MAX_INT_BYTES = MAX_EVENTS_PER_THREAD * 4 * 8

class Tracer:
    """Collects spans from every thread of the process."""

    def __init__(self, path: str | None = None, enabled: bool = False, level: str = "layer") -> None:
        self.enabled = enabled
        self.path = path
        self.level = level
        self.skip_cats = level_skips(level)
        self._local = threading.local()
        self._buffers: list[_ThreadBuffer] = []
        self._lock = threading.Lock()
        # Anchor of the span clock on the wall clock, so other samplers (py-spy, a
        # PyTorch profiler trace) can be aligned with these spans later.
        self.origin_perf_ns = time.perf_counter_ns()
        self.origin_unix_ns = time.time_ns()

    def _buffer(self) -> _ThreadBuffer:
        buf: _ThreadBuffer | None = getattr(self._local, "buf", None)
        if buf is None:
            thread = threading.current_thread()
            buf = _ThreadBuffer(threading.get_native_id(), thread.name, threading.get_ident())
            self._local.buf = buf
            with self._lock:
                self._buffers.append(buf)
        return buf

    def record(self, name: str, cat: str, start_ns: int, dur_ns: int, args: dict[str, Any] | None) -> None:
        try:
            buf = self._local.buf
        except AttributeError:
            buf = self._buffer()
        if len(buf.flat) < MAX_FLAT:
            buf.add((name, cat, start_ns, start_ns + dur_ns if dur_ns >= 0 else -1, args))
        else:
            buf.dropped += 1

    def int_sink(self, cat: str) -> Callable[[bytes], None] | None:
        """Where this thread appends records of a registered layout (``int_sink`` below)."""
        if not self.enabled or cat in self.skip_cats:
            return None
        try:
            buf = self._local.buf
        except AttributeError:
            buf = self._buffer()
        return buf.add_ints if len(buf.ints) < MAX_INT_BYTES else buf.drop

    def reset(self) -> None:
        with self._lock:
            for buf in self._buffers:
                buf.flat.clear()
                # Emptied in place, not replaced: a sink handed out before the reset is
                # this array's bound extend, and must keep writing where snapshot reads.
                del buf.ints[:]
                buf.dropped = 0

    def snapshot(self, process_name: str | None = None) -> dict[str, Any]:
        """The trace so far as a Chrome trace JSON object (``traceEvents`` form); its process
        is labelled ``process_name`` (a worker's role), else ``pid N``."""
        pid = os.getpid()
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": process_name or f"pid {pid}"}}
        ]
        with self._lock:
            buffers = list(self._buffers)
        dropped = 0
        for buf in buffers:
            events.append({"ph": "M", "pid": pid, "tid": buf.tid, "name": "thread_name", "args": {"name": buf.name, "ident": buf.ident}})
            dropped += buf.dropped
            flat = list(buf.flat)
            for i in range(0, len(flat), FIELDS):
                name, cat, start_ns, end_ns, args = flat[i : i + FIELDS]
                events.append(self._event(pid, buf.tid, name, cat, start_ns, end_ns, args))
            # The integer records come after the thread's other events (not interleaved by
            # completion); readers order events by their timestamps.
            expanded, unreadable = expand_records(memoryview(bytes(buf.ints)).cast("q"))
            dropped += unreadable
            for name, cat, start_ns, end_ns, args in expanded:
                events.append(self._event(pid, buf.tid, name, cat, start_ns, end_ns, args))
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "infra_agent.tracing",
                "clock_origin_unix_ns": self.origin_unix_ns,
                "dropped_events": dropped,
                "level": self.level,
            },
        }

    def _event(self, pid: int, tid: int, name: str, cat: str, start_ns: int, end_ns: int,
               args: dict[str, Any] | None) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "name": name,
            "cat": cat,
            "pid": pid,
            "tid": tid,
            "ts": (start_ns - self.origin_perf_ns) / 1000.0,
        }
        if end_ns < 0:
            ev["ph"] = "i"
            ev["s"] = "t"
        else:
            ev["ph"] = "X"
            # The end's own µs value less the start's, so that a span ending where the next
            # starts reads ts + dur == the next ts (the engine's contiguous phases).
            ev["dur"] = (end_ns - self.origin_perf_ns) / 1000.0 - ev["ts"]
        if args:
            ev["args"] = args
        return ev

    def dump(self, path: str | os.PathLike[str] | None = None) -> Path:
        target = Path(path or self.path or "infra-agent.trace.json")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(self.snapshot(), fh)
        os.replace(tmp, target)  # a reader never sees a half-written trace
        return target


def level_skips(level: str) -> frozenset[str]:
    try:
        return LEVELS[level]
    except KeyError:
        raise ValueError(f"trace level {level!r}: expected one of {sorted(LEVELS)} ({LEVEL_ENV_VAR})") from None


_TRACER: Tracer | None = None
_TRACER_LOCK = threading.Lock()


def get_tracer() -> Tracer:
    """The process tracer, configured from ``INFRA_AGENT_TRACE`` on first use."""
    global _TRACER
    if _TRACER is None:
        with _TRACER_LOCK:
            if _TRACER is None:
                path = os.environ.get(ENV_VAR) or None
                tracer = Tracer(path=path, enabled=path is not None, level=os.environ.get(LEVEL_ENV_VAR) or "layer")
                if path is not None:
                    atexit.register(_dump_at_exit, tracer)
                    _watch_gc()
                _TRACER = tracer
    return _TRACER


# The start of the collection in progress: collections never nest, and the thread that
# triggers one holds the GIL until it ends, so one slot serves every thread.
_GC_START = [0]


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    """A ``gc`` span per collection of the cyclic collector, on the thread it stalled.

    A full collection walks every tracked object of the process (~100 ms for a serving
    engine whose heap is not frozen) and stops the thread that allocated at that moment,
    mid-step; without its own span that time is silently part of whatever span was open.
    """
    tracer = _TRACER
    if tracer is None or not tracer.enabled or "gc" in tracer.skip_cats:
        _GC_START[0] = 0
        return
    if phase == "start":
        _GC_START[0] = perf_counter_ns()
        return
    start, _GC_START[0] = _GC_START[0], 0
    if start:
        end = perf_counter_ns()  # the pause ends here; naming its cause below is no part of it
        args = {"generation": int(info.get("generation", -1)), "collected": int(info.get("collected", 0)),
                "uncollectable": int(info.get("uncollectable", 0))}
        # The frame below this callback allocated the object that crossed the collector's
        # threshold: under allocation churn, the code that churns (trace/gc_pauses.py).
        args.update(allocating_site(sys._getframe(1)))
        tracer.record("gc", "gc", start, end - start, args)


def _watch_gc() -> None:
    """Record collections from now on (idempotent; the callback checks the tracer each time)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _dump_at_exit(tracer: Tracer) -> None:
    if tracer.enabled and tracer.path:
        tracer.dump(tracer.path)


class span:
    """A timed interval; a context manager and a decorator."""

    __slots__ = ("_start", "args", "cat", "name")

    def __init__(self, name: str, cat: str = "default", **args: Any) -> None:
        self.name = name
        self.cat = cat
        self.args = args or None
        self._start = 0

    def __enter__(self) -> span:
        tracer = _TRACER or get_tracer()
        if tracer.enabled and self.cat not in tracer.skip_cats:
            self._start = perf_counter_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        start = self._start
        if start:
            # Tracer.record inlined: this runs ~30 times per engine step, and every call
            # and lookup saved here is throughput the trace does not take away (a plain
            # attribute read of the thread's buffer, its bound ``extend``, the duration
            # taken at snapshot time: ~0.1 µs of the ~0.5 µs a recorded span cost).
            end = perf_counter_ns()
            self._start = 0
            tracer = _TRACER or get_tracer()
            try:
                buf = tracer._local.buf
            except AttributeError:
                buf = tracer._buffer()
            if len(buf.flat) < MAX_FLAT:
                buf.add((self.name, self.cat, start, end, self.args))
            else:
                buf.dropped += 1

    def __call__(self, fn: F) -> F:
        name, cat, args = self.name, self.cat, self.args or {}

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            tracer = _TRACER or get_tracer()
            if not tracer.enabled or cat in tracer.skip_cats:
                return fn(*a, **kw)
            start = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                tracer.record(name, cat, start, time.perf_counter_ns() - start, args or None)

        return wrapper  # type: ignore[return-value]


def instant(name: str, cat: str = "default", **args: Any) -> None:
    tracer = _TRACER or get_tracer()
    if tracer.enabled and cat not in tracer.skip_cats:
        tracer.record(name, cat, perf_counter_ns(), -1, args or None)


def is_enabled() -> bool:
    return (_TRACER or get_tracer()).enabled


def records(cat: str) -> bool:
    """Whether spans of ``cat`` are recorded now (tracing on, and the level keeps them)."""
    tracer = _TRACER or get_tracer()
    return tracer.enabled and cat not in tracer.skip_cats


def int_sink(cat: str) -> Callable[[bytes], None] | None:
    """Where this thread records spans of ``cat`` as integers, or None when ``cat`` is not
    recorded now.  Call the sink with one packed record, ``layout.pack(layout.id, ...)``
    (``register_layout``); the events are built from it only when the trace is read.

    The cheapest way to trace a hot loop whose spans have a fixed shape: ask once per
    iteration (this replaces ``records``), and the record is then one ``struct`` pack and
    one ``bytearray.extend``, with nothing kept but 8 bytes a value.  The engine's step
    kept its timestamps and args as objects through a call chain, and paid ~1% of a
    ~0.3 ms step on ``tiny`` for it (docs/performance.md, "Tracing overhead")."""
    return (_TRACER or get_tracer()).int_sink(cat)


def enable(path: str | os.PathLike[str] | None = None, level: str | None = None) -> Tracer:
    """Switch tracing on; ``level`` ("layer" or "step", see LEVELS) if given."""
    tracer = get_tracer()
    if path is not None:
        tracer.path = str(path)
    if level is not None:
        tracer.skip_cats = level_skips(level)
        tracer.level = level
    tracer.enabled = True
    _watch_gc()
    return tracer


def disable() -> None:
    get_tracer().enabled = False


def reset() -> None:
    get_tracer().reset()


def snapshot() -> dict[str, Any]:
    return get_tracer().snapshot()


def dump(path: str | os.PathLike[str] | None = None) -> Path:
    return get_tracer().dump(path)
