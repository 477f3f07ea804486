"""Who held the GIL while a thread waited, from py-spy ``--gil`` samples.

Definitions (docs/timeline.md repeats them):

- **GIL holder timeline.**  With ``--gil`` py-spy keeps only the GIL holder's sample,
  and its chrometrace output records a thread only when its stack changes.  So each
  sample is evidence that its thread held the GIL at that time, and the holder is
  taken to be the thread of the latest sample until the next sample of any thread (or
  the end of the sampled window).  Precision is bounded by how often stacks change;
  a stretch in which *no* thread held the GIL cannot be told apart in this format and
  is credited to the last holder.
- **Waiting.**  A thread *waits* during the parts of its spans in which it did not
  hold the GIL: inside the sampled window, no sample of its own that owns the GIL (a
  dump's owner counts as holding it even when py-spy calls it idle: it may sleep in a
  native call that never released the GIL).  A thread in native code with the GIL released also
  "waits" by this definition; the holder shares say whether another thread was
  running Python (or native code holding the GIL) meanwhile.
- **Dump snapshots** (``PySpyDumpSampler``): each snapshot lists every thread with
  ``owns_gil``; it stands for the time up to the midpoints with its neighbours.
- **Attribution.**  For every waiting interval: which thread held the GIL and in
  which frame (innermost Python frame, ``file:line``), as shares of the waiting time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from infra_agent.trace.intervals import (
    Interval,
    intersect,
    merge,
    merged_by_group,
    subtract,
    total,
)
from infra_agent.trace.model import Sample, Timeline, snapshot_bounds


@dataclass(frozen=True)
class HolderSegment:
    start_us: float
    end_us: float
    thread: str
    where: str  # file:line of the innermost frame ("?" when the stack was empty)
    function: str
    idle: bool = False  # a dump's owner that py-spy called idle: it keeps the GIL without running


@dataclass
class Holder:
    thread: str
    where: str
    function: str
    us: float
    share: float

    def to_dict(self) -> dict[str, object]:
        return {"thread": self.thread, "where": self.where, "function": self.function, "us": self.us,
                "share": self.share}


@dataclass
class WaitReport:
    """One (span group, thread)'s waiting time and who held the GIL meanwhile."""

    group: str
    thread: str
    span_us: float  # sampled span time of the group on the thread
    waiting_us: float
    intervals: int  # how many separate waiting intervals
    holders: list[Holder] = field(default_factory=list)  # by thread and frame, largest first
    holder_threads: dict[str, float] = field(default_factory=dict)  # thread -> share
    longest: list[dict[str, object]] = field(default_factory=list)  # a few longest intervals, each attributed
    # thread -> share of the wait it held the GIL while idle (a native call that sleeps or blocks
    # and keeps the GIL): holding that costs the holder nothing to give up
    idle_holders: dict[str, float] = field(default_factory=dict)
    # From dump snapshots: the part of the wait spent waiting *for the GIL* (not in its own I/O,
    # a lock, or without a CPU), and thread -> share of that part it owned the GIL; None without
    # snapshots (a --gil recording keeps only the holder's samples)
    gil_wait_us: float | None = None
    gil_wait_holders: dict[str, float] = field(default_factory=dict)

    @property
    def waiting_share(self) -> float:
        return self.waiting_us / self.span_us if self.span_us else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"group": self.group, "thread": self.thread, "span_us": self.span_us, "waiting_us": self.waiting_us,
                "waiting_share": self.waiting_share, "intervals": self.intervals,
                "holders": [h.to_dict() for h in self.holders], "holder_threads": self.holder_threads,
                "longest": self.longest, "idle_holders": self.idle_holders, "gil_wait_us": self.gil_wait_us,
                "gil_wait_holders": self.gil_wait_holders}


def _snapshot_timeline(samples: list[Sample], window: Interval) -> list[HolderSegment]:
    """Dump snapshots: each one stands for the time up to the midpoints with its neighbours;
    a snapshot in which no thread owns the GIL leaves its stretch without a holder.

    A thread that owns the GIL is its holder also when py-spy calls it idle: a native call
    that sleeps or blocks without releasing the GIL (a ``PyDLL`` call, a C extension that
    never drops it) is idle to the OS and still keeps every other thread out."""
    times = sorted({s.ts_us for s in samples})
    holder = {s.ts_us: s for s in samples if s.holds_gil}
    out: list[HolderSegment] = []
    for t, (lo, hi) in zip(times, snapshot_bounds(times, window), strict=True):
        s = holder.get(t)
        if s is not None and hi > lo:
            leaf = s.leaf
            out.append(HolderSegment(lo, hi, s.thread, leaf.where() if leaf else "?", leaf.name if leaf else "?",
                                     idle=s.idle))
    return out


def holder_timeline(samples: list[Sample], window: Interval) -> list[HolderSegment]:
    """Piecewise-constant GIL holder from ``--gil`` samples (see the module docstring)."""
    if samples and all(s.snapshot for s in samples):
        return _snapshot_timeline(samples, window)
    held = sorted((s for s in samples if s.holds_gil and not s.idle), key=lambda s: s.ts_us)
    out: list[HolderSegment] = []
    for i, s in enumerate(held):
        end = held[i + 1].ts_us if i + 1 < len(held) else window[1]
        if end <= s.ts_us:
            continue
        leaf = s.leaf
        out.append(HolderSegment(s.ts_us, end, s.thread, leaf.where() if leaf else "?", leaf.name if leaf else "?"))
    return out


def attribute(interval_list: list[Interval], segments: list[HolderSegment], exclude: str | None = None) -> dict[tuple[str, str, str], float]:
    """µs per (holder thread, where, function) over merged ``interval_list``."""
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    j = 0
    for s, e in interval_list:
        while j < len(segments) and segments[j].end_us <= s:
            j += 1
        k = j
        while k < len(segments) and segments[k].start_us < e:
            seg = segments[k]
            both = min(e, seg.end_us) - max(s, seg.start_us)
            if both > 0 and seg.thread != exclude:
                out[(seg.thread, seg.where, seg.function)] += both
            k += 1
    return out


def _holders(acc: dict[tuple[str, str, str], float], denom: float, top: int = 8) -> tuple[list[Holder], dict[str, float]]:
    by_thread: dict[str, float] = defaultdict(float)
    for (thread, _, _), us in acc.items():
        by_thread[thread] += us
    holders = [Holder(t, w, f, us, us / denom if denom else 0.0)
               for (t, w, f), us in sorted(acc.items(), key=lambda kv: -kv[1])[:top]]
    return holders, {t: (us / denom if denom else 0.0) for t, us in sorted(by_thread.items(), key=lambda kv: -kv[1])}


def waiting_analysis(timeline: Timeline, by: str = "cat", min_wait_us: float = 0.0,
                     threads: set[str] | None = None) -> tuple[list[WaitReport], dict[str, list[Interval]]]:
    """Waiting per (group, thread) with GIL attribution; also {thread: waiting intervals}.

    Only threads py-spy saw at least once are analysed (a thread with no sample at all
    may simply not have been matched to a span thread); ``threads`` narrows further.
    """
    if not timeline.samples or timeline.sampled_window is None:
        return [], {}
    from infra_agent.trace.thread_states import gil_wait_intervals

    window = timeline.sampled_window
    segments = holder_timeline(timeline.samples, window)
    snapshots = all(s.snapshot for s in timeline.samples)
    gil_waits = gil_wait_intervals(timeline) if snapshots else {}
    seen = {s.thread for s in timeline.samples}
    spans = [s for s in timeline.span_sources() if s.thread in seen and (threads is None or s.thread in threads)]
    holding: dict[str, list[Interval]] = defaultdict(list)
    for seg in segments:
        holding[seg.thread].append((seg.start_us, seg.end_us))
    not_holding = {t: subtract([window], merge(holding.get(t, []))) for t in seen}
    reports: list[WaitReport] = []
    per_thread: dict[str, list[Interval]] = defaultdict(list)
    idle_segments = [g for g in segments if g.idle]
    for (group, thread), ivs in sorted(merged_by_group(spans, by).items()):
        sampled = intersect(ivs, [window])
        if not sampled:
            continue
        waiting = [iv for iv in intersect(sampled, not_holding[thread]) if iv[1] - iv[0] >= min_wait_us]
        per_thread[thread] += waiting
        waited = total(waiting)
        acc = attribute(waiting, segments, exclude=thread)
        holders, by_thread = _holders(acc, waited)
        longest: list[dict[str, object]] = []
        for s, e in sorted(waiting, key=lambda iv: iv[0] - iv[1])[:3]:
            one = attribute([(s, e)], segments, exclude=thread)
            top, _ = _holders(one, e - s, top=1)
            longest.append({"start_us": s, "end_us": e, "dur_us": e - s,
                            "holder": top[0].to_dict() if top else None})
        idle = attribute(waiting, idle_segments, exclude=thread)
        _, idle_by_thread = _holders(idle, waited)
        report = WaitReport(group, thread, total(sampled), waited, len(waiting), holders, by_thread, longest,
                            idle_by_thread)
        if snapshots:
            for_gil = intersect(waiting, merge(gil_waits.get(thread, [])))
            report.gil_wait_us = total(for_gil)
            _, report.gil_wait_holders = _holders(attribute(for_gil, segments, exclude=thread), report.gil_wait_us)
        reports.append(report)
    reports.sort(key=lambda r: -r.waiting_us)
    return reports, {t: merge(v) for t, v in per_thread.items()}


def holder_shares(timeline: Timeline, interval_list: list[Interval], exclude: str | None = None) -> tuple[list[Holder], dict[str, float]]:
    """Who held the GIL during arbitrary (merged) intervals, e.g. all ``ep.dispatch`` spans."""
    if timeline.sampled_window is None:
        return [], {}
    segments = holder_timeline(timeline.samples, timeline.sampled_window)
    ivs = intersect(merge(interval_list), [timeline.sampled_window])
    return _holders(attribute(ivs, segments, exclude=exclude), total(ivs))
