"""py-spy's Chrome-trace output, read back into per-thread stack samples.

What ``py-spy record --format chrometrace --gil --idle -r RATE -o out.json --pid PID``
writes (read from the files py-spy 0.4 produces and its ``src/chrometrace.rs``):

- a bare JSON list; every event has ``cat: "py-spy"``, ``pid``, ``tid``, ``ts`` (µs
  since py-spy started recording: see :mod:`infra_agent.trace.clock`), ``name`` (the
  function) and ``args.filename``/``args.line``;
- no event per sample: consecutive samples of a thread are *merged*.  When a sample's
  stack differs from the thread's previous one, py-spy emits ``E`` for the frames that
  left and ``B`` for the frames that came, all at that sample's ``ts``; an unchanged
  stack emits nothing.  At the end every open frame gets an ``E`` at the time of
  writing.  A consequence that matters here: a thread holding the GIL with one
  unchanging stack (a native call spinning) leaves *no* event after the first, so
  GIL attribution from this format under-credits such threads; prefer the dump
  samples below;
- ``tid``: py-spy 0.4.x writes the thread's pthread id (``threading.get_ident()``)
  and no thread names; newer py-spy remaps tids to 0, 1, ... and adds ``M``
  ``thread_name`` events named ``"<pthread id>: <thread name>"``.  Our tracer records
  each thread's pthread id (``args.ident`` of its ``thread_name`` event), which is how
  samples are matched to span threads either way;
- ``--gil`` keeps only the sample of the thread holding the GIL, so every event is
  evidence that its thread held the GIL at ``ts``; ``--idle`` keeps samples py-spy
  deems idle, but the file does not mark them (with ``--gil`` the holder is rarely
  idle, so little is lost).

The second format, written by :class:`infra_agent.trace.sampler.PySpyDumpSampler`, is
JSON lines of ``py-spy dump --json`` snapshots (``{"ts_unix_ns", "threads"}``): every
thread with ``owns_gil``, ``active``, ``os_thread_id`` (our tracer's tid) and its stack
(innermost frame first), at a unix time: exact, but a few Hz.

Reading the chrometrace back: every distinct (thread, ts) at which events occur becomes a
:class:`Sample` with the thread's stack after those events.  The closing ``E`` events
at the end are not samples; their ``ts`` ends the sampled window.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from infra_agent.trace.clock import SourceClock
from infra_agent.trace.model import Frame, Sample, Timeline


def pyspy_clock(path: Path, last_ts: float, start_unix_ns: int | None, offset_us: float) -> SourceClock:
    """py-spy's zero: given, else the file's mtime minus its last ts (see clock.py)."""
    if start_unix_ns is not None:
        return SourceClock(start_unix_ns, how="py-spy start given by the caller", offset_us=offset_us)
    try:
        mtime_ns = os.stat(path).st_mtime_ns
    except OSError:
        return SourceClock(None, how="py-spy file has no mtime: not aligned", offset_us=offset_us)
    return SourceClock(int(mtime_ns - last_ts * 1000), how="py-spy: file mtime minus its last ts (estimate, ~ms)",
                       offset_us=offset_us)


def add_recording(timeline: Timeline, events: Any, path: Path, idents: dict[int, str],
                  start_unix_ns: int | None = None, offset_us: float = 0.0, gil: bool = True) -> int:
    """Add a py-spy chrometrace recording's samples to ``timeline``; returns their count.

    ``idents`` maps pthread ids to span thread names (from our trace's metadata).
    """
    from infra_agent.trace.load import TraceLoadError, _num

    if not isinstance(events, list):
        raise TraceLoadError(f"{path}: expected py-spy chrometrace output (a JSON list of events), "
                             f"got {type(events).__name__}")
    names: dict[int, str] = {}
    rows: list[tuple[int, float, str, Frame]] = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise TraceLoadError(f"{path}: event [{i}] is {type(ev).__name__}, expected an object")
        ph = ev.get("ph")
        tid = ev.get("tid")
        if not isinstance(tid, int):
            raise TraceLoadError(f"{path}: event [{i}]: expected an integer 'tid', got {tid!r}")
        args: dict[str, Any] = ev["args"] if isinstance(ev.get("args"), dict) else {}
        if ph == "M" and ev.get("name") == "thread_name":
            label = str(args.get("name") or "")
            ident_s, _, tname = label.partition(": ")
            if ident_s.isdigit() and int(ident_s) in idents:
                names[tid] = idents[int(ident_s)]
            else:
                names[tid] = tname or label or f"py-spy tid {tid}"
            continue
        if ph not in ("B", "E"):
            continue
        line = args.get("line")
        frame = Frame(str(ev.get("name", "")), str(args.get("filename") or "?"), line if isinstance(line, int) else None)
        rows.append((tid, _num(ev, "ts", path, i), ph, frame))
    if not rows:
        timeline.warnings.append(f"{path}: py-spy recording holds no samples")
        return 0
    last_ts = max(r[1] for r in rows)
    # The trailing run of E events at the last ts closes the open frames: not a sample.
    end = len(rows)
    while end > 0 and rows[end - 1][2] == "E" and rows[end - 1][1] == last_ts:
        end -= 1
    clock = pyspy_clock(path, last_ts, start_unix_ns, offset_us)
    origin = timeline.origin_unix_ns

    def thread_of(tid: int) -> str:
        if tid in names:
            return names[tid]
        return idents.get(tid, f"py-spy tid {tid}")

    stacks: dict[int, list[Frame]] = {}
    samples: list[Sample] = []
    i = 0
    while i < end:
        tid, ts = rows[i][0], rows[i][1]
        stack = stacks.setdefault(tid, [])
        while i < end and rows[i][0] == tid and rows[i][1] == ts:
            _, _, ph, frame = rows[i]
            if ph == "B":
                stack.append(frame)
            elif stack:
                # E names the frame that left; frames leave innermost first
                stack.pop()
            i += 1
        samples.append(Sample(clock.to_timeline_us(ts, origin), thread_of(tid), tuple(stack), tid, holds_gil=gil))
    if origin is None and clock.zero_unix_ns is not None and not timeline.spans:
        # a py-spy recording alone: its own zero is the timeline's (the times are unchanged)
        timeline.origin_unix_ns = origin = clock.zero_unix_ns
    timeline.samples.extend(samples)
    timeline.samples.sort(key=lambda s: s.ts_us)
    first_ts = rows[0][1]
    timeline.sampled_window = (clock.to_timeline_us(first_ts, origin), clock.to_timeline_us(last_ts, origin))
    unmatched = sorted({s.thread for s in samples if s.thread.startswith("py-spy tid")})
    if unmatched and timeline.spans:
        timeline.warnings.append(f"{path}: {len(unmatched)} py-spy thread(s) not matched to a span thread (the span "
                                 "trace has no pthread ids: record it with this version of infra_agent.tracing)")
    timeline.sources.append({"path": str(path), "format": "pyspy", "clock": clock.describe(), "samples": len(samples),
                             "gil": gil})
    return len(samples)


def add_dumps(timeline: Timeline, path: Path, tid_names: dict[int, str]) -> int:
    """Add py-spy dump snapshots (JSON lines) to ``timeline``; ``tid_names``: native tid -> thread."""
    from infra_agent.trace.load import TraceLoadError

    snapshots: list[tuple[int, list[Any]]] = []
    offset = 0
    for n, line in enumerate(path.read_bytes().splitlines(keepends=True), 1):
        if line.strip():
            try:
                doc = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                pos = getattr(exc, "pos", 0) or 0
                raise TraceLoadError(f"{path}: invalid JSON on line {n} at byte {offset + pos}: "
                                     f"{getattr(exc, 'msg', exc)}") from None
            if not (isinstance(doc, dict) and isinstance(doc.get("ts_unix_ns"), int) and isinstance(doc.get("threads"), list)):
                raise TraceLoadError(f"{path}: line {n}: expected {{'ts_unix_ns': int, 'threads': [...]}}")
            snapshots.append((doc["ts_unix_ns"], doc["threads"]))
        offset += len(line)
    if not snapshots:
        timeline.warnings.append(f"{path}: py-spy dump file holds no samples")
        return 0
    if timeline.origin_unix_ns is None:
        timeline.origin_unix_ns = snapshots[0][0]
    origin = timeline.origin_unix_ns
    count = 0
    for ts_ns, threads in snapshots:
        ts = (ts_ns - origin) / 1000.0
        for th in threads:
            if not isinstance(th, dict):
                continue
            tid = int(th.get("os_thread_id") or 0)
            frames = tuple(Frame(str(f.get("name", "")), str(f.get("filename") or "?"),
                                 f.get("line") if isinstance(f.get("line"), int) else None)
                           for f in reversed(th.get("frames") or []) if isinstance(f, dict))
            name = tid_names.get(tid) or str(th.get("thread_name") or f"tid {tid}")
            timeline.samples.append(Sample(ts, name, frames, tid, holds_gil=bool(th.get("owns_gil")),
                                           idle=not th.get("active", True), snapshot=True))
            count += 1
    timeline.samples.sort(key=lambda s: s.ts_us)
    times = [(t - origin) / 1000.0 for t, _ in snapshots]
    half = (times[-1] - times[0]) / (2 * (len(times) - 1)) if len(times) > 1 else 0.0
    timeline.sampled_window = (times[0] - half, times[-1] + half)
    timeline.sources.append({"path": str(path), "format": "pyspy-dump", "samples": len(snapshots),
                             "clock": {"zero_unix_ns": origin, "unit_ns": 1000.0,
                                       "how": "py-spy dump: unix time of each dump (midpoint)", "offset_us": 0.0}})
    return count
