"""The critical path through one request.

Convention (docs/timeline.md): a span or instant belongs to request R when its args
carry ``rid == R`` (``request_id`` is accepted too, which refstack's HTTP instants
use), or ``rids`` is a list containing R (a batched step serving several requests).
The request's window runs from its first event to its last.

The path is built backwards from the window's end: at each time, the request's span
that is active and ends latest is on the path down to its start; time covered by none
of the request's spans is filled with the shared top-level span active then on any
thread (a step carrying no rid: ``shared``), or left as ``untraced``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from infra_agent.trace.model import NS_SLACK_US, Span, Timeline

RID_KEYS = ("rid", "request_id")


def request_ids(args: dict[str, Any]) -> list[str]:
    out = [str(args[k]) for k in RID_KEYS if args.get(k) is not None]
    rids = args.get("rids")
    if isinstance(rids, list):
        out += [str(r) for r in rids]
    return out


@dataclass
class PathSegment:
    name: str
    thread: str
    start_us: float
    end_us: float
    kind: str  # "request" (carries the rid), "shared" (no rid, covering), "untraced"

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "thread": self.thread, "start_us": self.start_us, "end_us": self.end_us,
                "dur_us": self.end_us - self.start_us, "kind": self.kind}


@dataclass
class CriticalPath:
    rid: str
    start_us: float
    end_us: float
    segments: list[PathSegment] = field(default_factory=list)

    def shares(self) -> dict[str, float]:
        """Share of the request's time per span name (untraced included)."""
        width = self.end_us - self.start_us
        acc: dict[str, float] = defaultdict(float)
        for seg in self.segments:
            acc[seg.name] += seg.end_us - seg.start_us
        return {k: v / width for k, v in sorted(acc.items(), key=lambda kv: -kv[1])} if width > 0 else {}

    def to_dict(self) -> dict[str, object]:
        return {"rid": self.rid, "start_us": self.start_us, "end_us": self.end_us,
                "dur_us": self.end_us - self.start_us, "shares": self.shares(),
                "segments": [s.to_dict() for s in self.segments]}


def _top_level(spans: list[Span]) -> list[Span]:
    """Spans not nested inside another span of the same thread."""
    out: list[Span] = []
    by_thread: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_thread[s.thread].append(s)
    for ss in by_thread.values():
        end = float("-inf")
        for s in sorted(ss, key=lambda s: (s.start_us, -s.end_us)):
            if s.start_us >= end - NS_SLACK_US:  # back to back counts as after (NS_SLACK_US)
                out.append(s)
            end = max(end, s.end_us)
    return out


def critical_path(timeline: Timeline, rid: str, shared: list[Span] | None = None) -> CriticalPath | None:
    """``shared``: the top-level spans with no request id (computed once by critical_paths)."""
    spans = timeline.span_sources()
    mine = [s for s in spans if rid in request_ids(s.args)]
    marks = [i.ts_us for i in timeline.instants if rid in request_ids(i.args)]
    times = [s.start_us for s in mine] + [s.end_us for s in mine] + marks
    if not times:
        return None
    start, end = min(times), max(times)
    if shared is None:
        shared = sorted((s for s in _top_level(spans) if not request_ids(s.args)), key=lambda s: s.start_us)
    path = CriticalPath(rid, start, end)
    t = end
    while t > start:
        active = [s for s in mine if s.start_us < t <= s.end_us]
        if active:
            s = max(active, key=lambda s: (s.end_us, -s.start_us))
            lo = max(s.start_us, start)
            path.segments.append(PathSegment(s.name, s.thread, lo, t, "request"))
            t = lo
            continue
        # nothing of the request is active just before t: the latest request span ending before t
        earlier = [s.end_us for s in mine if s.end_us < t]
        gap_start = max(earlier + [start])
        cover = [s for s in shared if s.start_us < t and s.end_us > gap_start]
        cursor = t
        for s in sorted(cover, key=lambda s: -s.end_us):
            seg_end, seg_start = min(cursor, s.end_us), max(gap_start, s.start_us)
            if seg_end <= seg_start:
                continue
            if seg_end < cursor:
                path.segments.append(PathSegment("untraced", "-", seg_end, cursor, "untraced"))
            path.segments.append(PathSegment(s.name, s.thread, seg_start, seg_end, "shared"))
            cursor = seg_start
        if cursor > gap_start:
            path.segments.append(PathSegment("untraced", "-", gap_start, cursor, "untraced"))
        t = gap_start
    path.segments.reverse()
    return path


def critical_paths(timeline: Timeline, limit: int = 50) -> list[CriticalPath]:
    """Critical paths of every request id found (the first ``limit``, in order of start)."""
    seen: dict[str, None] = {}
    for s in timeline.span_sources():
        for r in request_ids(s.args):
            seen.setdefault(r, None)
    for i in timeline.instants:
        for r in request_ids(i.args):
            seen.setdefault(r, None)
    shared = sorted((s for s in _top_level(timeline.span_sources()) if not request_ids(s.args)), key=lambda s: s.start_us)
    out = [p for p in (critical_path(timeline, r, shared) for r in list(seen)[:limit]) if p is not None]
    return sorted(out, key=lambda p: p.start_us)
