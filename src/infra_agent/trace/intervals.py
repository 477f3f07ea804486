"""Interval arithmetic over spans: merging, grouping, union and intersection lengths.

A span category on a thread is a *set of times*, not a list of spans: nested spans
(``decode`` inside ``engine.step``) and back-to-back spans of one category must count
once.  Merging first is what makes every later number (overlap, busy time, shares) a
measure of time rather than a sum of durations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from infra_agent.trace.model import Span

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same times (touching ones joined)."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Length of merged intervals (pass merged ones; overlapping ones are counted twice)."""
    return sum(e - s for s, e in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two merged interval lists (a two-pointer walk)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Times in ``a`` not in ``b`` (both merged)."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    return intersect(intervals, [window]) if window[1] > window[0] else []


def group_key(span: Span, by: str) -> str:
    """The label of a span's group: its category (``by="cat"``) or its name (``by="name"``).

    A span without a category falls back to its name, so foreign traces still group.
    """
    if by == "name":
        return span.name
    return span.cat or span.name


def merged_by_group(spans: Iterable[Span], by: str = "cat",
                    keep: Callable[[Span], bool] | None = None) -> dict[tuple[str, str], list[Interval]]:
    """{(group, thread): merged intervals} for the spans ``keep`` accepts."""
    raw: dict[tuple[str, str], list[Interval]] = defaultdict(list)
    for s in spans:
        if keep is None or keep(s):
            raw[(group_key(s, by), s.thread)].append((s.start_us, s.end_us))
    return {k: merge(v) for k, v in raw.items()}


@dataclass
class ThreadTime:
    """Where one thread's time went inside the analysis window (µs)."""

    thread: str
    window_us: float
    busy_us: float  # inside any span of the thread
    idle_us: float  # inside no span of the thread
    waiting_us: float = 0.0  # inside spans during which it waited (see gil.py); part of busy
    spans: int = 0

    @property
    def busy_share(self) -> float:
        return self.busy_us / self.window_us if self.window_us > 0 else 0.0

    def to_dict(self) -> dict[str, float | str | int]:
        return {"thread": self.thread, "window_us": self.window_us, "busy_us": self.busy_us, "idle_us": self.idle_us,
                "waiting_us": self.waiting_us, "busy_share": self.busy_share, "spans": self.spans}


def thread_times(spans: list[Span], window: Interval, waiting: dict[str, list[Interval]] | None = None) -> list[ThreadTime]:
    """Per-thread busy, idle and waiting time within ``window``, busiest thread first."""
    by_thread: dict[str, list[Interval]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for s in spans:
        by_thread[s.thread].append((s.start_us, s.end_us))
        counts[s.thread] += 1
    width = max(0.0, window[1] - window[0])
    out = []
    for thread, ivs in by_thread.items():
        busy = total(clip(merge(ivs), window))
        wait = total(clip(merge((waiting or {}).get(thread, [])), window))
        out.append(ThreadTime(thread, width, busy, width - busy, wait, counts[thread]))
    return sorted(out, key=lambda t: -t.busy_us)


def gaps(intervals: list[Interval], window: Interval, min_us: float = 0.0) -> list[Interval]:
    """Idle gaps of merged ``intervals`` within ``window`` at least ``min_us`` long."""
    return [g for g in subtract([window], intervals) if g[1] - g[0] >= min_us]
