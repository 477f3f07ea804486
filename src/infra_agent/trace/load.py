"""Loading traces onto one clock: our spans, Kineto traces, py-spy recordings.

``load_timeline`` is the entry point.  A file that is not JSON, is cut short, or has
the wrong shape raises :class:`TraceLoadError` naming the file and, for JSON errors,
the byte offset of the problem; the CLI prints it without a traceback.

Formats (detected from the content, not the file name):

- ours: ``{"traceEvents": [...], "otherData": {"producer": "infra_agent.tracing",
  "clock_origin_unix_ns": ...}}``; ph ``X`` (complete), ``B``/``E`` (paired per
  thread), ``i``/``I`` (instants), ``M`` (``thread_name``, whose ``args.ident`` is the
  thread's pthread id, used to match py-spy's threads);
- Kineto: an object with ``baseTimeNanoseconds`` (and ``deviceProperties``,
  ``schemaVersion``); ph ``X`` events with ``cat`` ``cpu_op``, ``kernel``,
  ``user_annotation``...;
- py-spy: a bare JSON list of ``B``/``E`` events with ``cat: "py-spy"`` (see
  :mod:`infra_agent.trace.pyspy`);
- any other Chrome trace JSON is read like ours, with no unix anchor.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from infra_agent.errors import InfraAgentError
from infra_agent.trace.clock import SourceClock
from infra_agent.trace.model import SOURCE_KINETO, SOURCE_SPANS, Instant, Span, Timeline


class TraceLoadError(InfraAgentError):
    """A trace file could not be read; the message names the file and where."""


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parse ``path``; errors name the file and the byte offset (never a traceback)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise TraceLoadError(f"{p}: cannot read trace: {exc.strerror or exc}") from None
    if raw[:2] == b"\x1f\x8b":  # gzip (torch.profiler's trace handler writes .json.gz with use_gzip)
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceLoadError(f"{p}: not a complete gzip stream ({exc}): truncated?") from None
    if not raw.strip():
        raise TraceLoadError(f"{p}: empty file, expected Chrome trace JSON")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceLoadError(f"{p}: not UTF-8 text at byte {exc.start}; expected Chrome trace JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        byte = len(text[: exc.pos].encode("utf-8"))  # json counts characters, editors count bytes
        hint = " (the file ends there: truncated?)" if byte >= len(raw.rstrip()) else ""
        raise TraceLoadError(
            f"{p}: invalid JSON at byte {byte} (line {exc.lineno}, column {exc.colno}): {exc.msg}{hint}"
        ) from None


def detect_format(doc: Any) -> str:
    """``ours``, ``kineto``, ``pyspy`` or ``chrome`` (a Chrome trace of another producer)."""
    if isinstance(doc, list):
        if any(isinstance(e, dict) and e.get("cat") == "py-spy" for e in doc[:50]):
            return "pyspy"
        return "chrome"
    if isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        if "baseTimeNanoseconds" in doc or "deviceProperties" in doc:
            return "kineto"
        other = doc.get("otherData")
        if isinstance(other, dict) and other.get("producer") == "infra_agent.tracing":
            return "ours"
        return "chrome"
    return "unknown"


def _events(doc: Any, path: Path) -> list[dict[str, Any]]:
    events = doc if isinstance(doc, list) else doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceLoadError(f"{path}: expected a JSON list of trace events or an object with a 'traceEvents' list, "
                             f"got {type(doc).__name__}")
    return events


def _id(val: Any) -> int:
    """pid/tid as an int: Kineto writes strings for some tracks ("Spans"); hash those stably."""
    if isinstance(val, int) and not isinstance(val, bool):
        return val
    if isinstance(val, str) and val.lstrip("-").isdigit():
        return int(val)
    return zlib.crc32(str(val).encode()) if val is not None else 0


def _num(ev: dict[str, Any], key: str, path: Path, index: int) -> float:
    val = ev.get(key)
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise TraceLoadError(f"{path}: traceEvents[{index}] ({ev.get('name')!r}, ph {ev.get('ph')!r}): "
                             f"expected a number for {key!r}, got {val!r}")
    return float(val)


def parse_chrome_events(events: list[Any], path: Path, clock: SourceClock, origin: int | None, source: str,
                        timeline: Timeline) -> dict[int, int]:
    """Add spans/instants of a Chrome event list to ``timeline``; returns {pthread ident: tid}.

    ``B``/``E`` pairs are matched per (pid, tid) as a stack; an ``E`` with no ``B`` is
    counted and reported, a ``B`` never closed ends at the last timestamp of the file
    (a trace dumped while a span was open).
    """
    names: dict[tuple[int, int], str] = {}
    idents: dict[int, int] = {}
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise TraceLoadError(f"{path}: traceEvents[{i}] is {type(ev).__name__}, expected an object")
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            args: dict[str, Any] = ev["args"] if isinstance(ev.get("args"), dict) else {}
            key = (_id(ev.get("pid")), _id(ev.get("tid")))
            names[key] = str(args.get("name") or f"tid {key[1]}")
            if isinstance(args.get("ident"), int):
                idents[args["ident"]] = key[1]

    def thread(pid: int, tid: int) -> str:
        return names.get((pid, tid), f"tid {tid}")

    open_: dict[tuple[int, int], list[tuple[dict[str, Any], float]]] = defaultdict(list)
    unmatched = 0
    last_ts = 0.0
    for i, ev in enumerate(events):
        ph = ev.get("ph")
        if ph not in ("X", "B", "E", "i", "I", "n"):
            continue
        ts = _num(ev, "ts", path, i)
        last_ts = max(last_ts, ts)
        pid, tid = _id(ev.get("pid")), _id(ev.get("tid"))
        args = ev["args"] if isinstance(ev.get("args"), dict) else {}
        name, cat = str(ev.get("name", "")), str(ev.get("cat") or "")
        if ph == "X":
            dur = _num(ev, "dur", path, i) if "dur" in ev else 0.0
            last_ts = max(last_ts, ts + dur)
            start = clock.to_timeline_us(ts, origin)
            timeline.spans.append(Span(name, cat, thread(pid, tid), start, start + dur * clock.unit_ns / 1000.0,
                                       dict(args), tid, pid, source))
        elif ph == "B":
            open_[(pid, tid)].append((ev, ts))
        elif ph == "E":
            stack = open_[(pid, tid)]
            if not stack:
                unmatched += 1
                continue
            bev, bts = stack.pop()
            bargs: dict[str, Any] = bev["args"] if isinstance(bev.get("args"), dict) else {}
            timeline.spans.append(Span(str(bev.get("name", "")), str(bev.get("cat") or ""), thread(pid, tid),
                                       clock.to_timeline_us(bts, origin), clock.to_timeline_us(ts, origin),
                                       {**bargs, **args}, tid, pid, source))
        else:
            timeline.instants.append(Instant(name, cat, thread(pid, tid), clock.to_timeline_us(ts, origin),
                                             dict(args), tid, pid))
    still_open = sum(len(v) for v in open_.values())
    for (pid, tid), stack in open_.items():
        for bev, bts in stack:
            bargs = bev["args"] if isinstance(bev.get("args"), dict) else {}
            timeline.spans.append(Span(str(bev.get("name", "")), str(bev.get("cat") or ""), thread(pid, tid),
                                       clock.to_timeline_us(bts, origin), clock.to_timeline_us(last_ts, origin),
                                       dict(bargs), tid, pid, source))
    if unmatched or still_open:
        timeline.warnings.append(f"{path}: {unmatched} 'E' event(s) without a 'B', {still_open} 'B' event(s) never "
                                 "closed (closed at the file's last timestamp)")
    return idents


def _span_clock(doc: dict[str, Any] | list[Any], fmt: str, path: Path) -> SourceClock:
    if fmt == "kineto" and isinstance(doc, dict):
        base = doc.get("baseTimeNanoseconds")
        if isinstance(base, int):
            return SourceClock(base, how="Kineto baseTimeNanoseconds + ts µs")
        return SourceClock(None, how="Kineto trace without baseTimeNanoseconds: not aligned")
    other = doc.get("otherData") if isinstance(doc, dict) else None
    if isinstance(other, dict) and isinstance(other.get("clock_origin_unix_ns"), int):
        return SourceClock(other["clock_origin_unix_ns"], how="otherData.clock_origin_unix_ns + ts µs")
    return SourceClock(None, how=f"{fmt} trace without a unix anchor: its ts taken as the timeline's µs")


def load_timeline(
    traces: Sequence[str | os.PathLike[str]] = (),
    pyspy: str | os.PathLike[str] | None = None,
    kineto: Sequence[str | os.PathLike[str]] = (),
    pyspy_start_unix_ns: int | None = None,
    pyspy_offset_us: float = 0.0,
    kineto_offset_us: float = 0.0,
) -> Timeline:
    """Load span traces, an optional py-spy recording and Kineto traces onto one clock.

    A file passed among ``traces`` is accepted in any of the formats (a Kineto trace, a
    py-spy recording or py-spy dumps given there is routed to the right parser).
    """
    from infra_agent.trace import pyspy as pyspy_mod

    timeline = Timeline()
    docs: list[tuple[Path, Any, str]] = []
    dumps: list[Path] = []
    for t in traces:
        if _is_dump_file(Path(t)):  # JSON lines of py-spy dumps: samples, whichever argument brought them
            dumps.append(Path(t))
            continue
        doc = read_json(t)
        docs.append((Path(t), doc, detect_format(doc)))
    for k in kineto:
        doc = read_json(k)
        fmt = detect_format(doc)
        docs.append((Path(k), doc, "kineto" if fmt in ("kineto", "chrome") else fmt))
    pyspy_paths = [p for p, _, f in docs if f == "pyspy"] + dumps + ([Path(pyspy)] if pyspy else [])
    for path, doc, fmt in docs:
        if fmt == "unknown":
            raise TraceLoadError(f"{path}: expected Chrome trace JSON (a list of events or an object with "
                                 f"'traceEvents'), got {type(doc).__name__}")
    # The timeline's zero: the first span trace with a unix anchor, else a Kineto one.
    for path, doc, fmt in sorted(docs, key=lambda d: d[2] != "ours"):
        if fmt in ("ours", "chrome", "kineto"):
            clock = _span_clock(doc, fmt, path)
            if clock.zero_unix_ns is not None:
                timeline.origin_unix_ns = clock.zero_unix_ns
                break
    idents: dict[int, str] = {}
    for path, doc, fmt in docs:
        if fmt == "pyspy":
            continue
        events = _events(doc, path)
        clock = _span_clock(doc, fmt, path)
        if fmt == "kineto" and kineto_offset_us:
            clock = SourceClock(clock.zero_unix_ns, clock.unit_ns, clock.how, kineto_offset_us)
        if clock.zero_unix_ns is None and timeline.origin_unix_ns is not None and len(docs) > 1:
            timeline.warnings.append(f"{path}: no unix anchor ({clock.how}); its times may not line up with the others")
        n_before = len(timeline.spans)
        source = SOURCE_KINETO if fmt == "kineto" else SOURCE_SPANS
        found = parse_chrome_events(events, path, clock, timeline.origin_unix_ns, source, timeline)
        for ident, tid in found.items():
            for s in timeline.spans[n_before:]:
                if s.tid == tid:
                    idents[ident] = s.thread
                    break
        source_info = {"path": str(path), "format": fmt, "clock": clock.describe(), "spans": len(timeline.spans) - n_before}
        other = doc.get("otherData") if isinstance(doc, dict) else None
        if fmt == "ours" and isinstance(other, dict) and isinstance(other.get("level"), str):
            # What the recorder left out by design ("step": no per-layer spans), so an
            # absent span group can be told from one that never ran.
            source_info["level"] = other["level"]
        timeline.sources.append(source_info)
    for path in pyspy_paths:
        if _is_dump_file(path):
            tid_names = {s.tid: s.thread for s in timeline.spans if s.source == SOURCE_SPANS}
            pyspy_mod.add_dumps(timeline, path, tid_names)
            continue
        doc = read_json(path)
        if detect_format(doc) != "pyspy" and not isinstance(doc, list):
            raise TraceLoadError(f"{path}: expected py-spy chrometrace output (a JSON list of B/E events with "
                                 f"cat 'py-spy'), got {type(doc).__name__}")
        pyspy_mod.add_recording(timeline, doc, path, idents, start_unix_ns=pyspy_start_unix_ns,
                                offset_us=pyspy_offset_us)
    _disambiguate_threads(timeline)
    return timeline


def _is_dump_file(path: Path) -> bool:
    """JSON lines of py-spy dumps start with a ``ts_unix_ns`` object (PySpyDumpSampler)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError:
        return False
    return head.startswith(b'{"ts_unix_ns"')


def _disambiguate_threads(timeline: Timeline) -> None:
    """Two processes' "MainThread"s are different threads: suffix the pid when names clash."""
    keys: dict[str, set[tuple[str, int, int]]] = defaultdict(set)
    for s in timeline.spans:
        keys[s.thread].add((s.source, s.pid, s.tid))
    clashing = {name for name, k in keys.items() if len({(src, pid) for src, pid, _ in k}) > 1}
    if not clashing:
        return
    for s in timeline.spans:
        if s.thread in clashing:
            s.thread = f"{s.thread}[{s.pid}]"
    for i in timeline.instants:
        if i.thread in clashing:
            i.thread = f"{i.thread}[{i.pid}]"
    # py-spy samples were named from the spans' native thread ids before this: follow them,
    # or a GIL holder "engine-loop" would match no span thread "engine-loop[PID]".
    by_tid = {s.tid: s.thread for s in timeline.spans if s.source == SOURCE_SPANS and s.tid}
    for smp in timeline.samples:
        if smp.thread in clashing and smp.tid in by_tid:
            smp.thread = by_tid[smp.tid]
