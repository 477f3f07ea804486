"""Pauses of Python's cyclic garbage collector, from the ``gc`` spans the tracer records.

A collection runs on whichever thread allocated past the threshold and holds the GIL
until it ends, so every Python thread of the process stops with it.  Young collections
take microseconds; a full (generation 2) one walks every tracked object of the process,
and in a serving engine whose model and imports were never frozen that is 80-100 ms on
refstack's ``small`` preset: one step in a few hundred takes ten times its length.  The
mean step barely moves, which is why only the timeline shows it (and p99 latency).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from infra_agent.trace.intervals import Interval, merge, total
from infra_agent.trace.model import Span

GC_SPAN = "gc"


@dataclass
class GCPauses:
    count: int
    total_us: float
    longest_us: float
    longest_generation: int
    window_us: float
    by_generation: dict[int, dict[str, float]] = field(default_factory=dict)  # gen -> count, total_us, longest_us
    by_thread: dict[str, float] = field(default_factory=dict)  # thread -> µs stopped in collections
    # Where the collections began, by the code whose allocation crossed the threshold (the
    # tracer's ``function``/``where`` args): {"function", "where", "count", "us", "share"}, largest first.
    sites: list[dict[str, Any]] = field(default_factory=list)

    @property
    def share(self) -> float:
        """The share of the window some thread spent in a collection (the process stood still)."""
        return self.total_us / self.window_us if self.window_us > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "total_us": self.total_us, "longest_us": self.longest_us,
                "longest_generation": self.longest_generation, "window_us": self.window_us, "share": self.share,
                "by_generation": {str(g): v for g, v in sorted(self.by_generation.items())},
                "by_thread": dict(sorted(self.by_thread.items(), key=lambda kv: -kv[1])), "sites": self.sites}


def gc_pauses(spans: list[Span], window: Interval) -> GCPauses | None:
    """The window's collections, or None when the trace has no ``gc`` span (tracer without
    the collector's callback, or no collection happened)."""
    mine = [s for s in spans if s.name == GC_SPAN and s.cat == GC_SPAN]
    if not mine:
        return None
    by_gen: dict[int, dict[str, float]] = defaultdict(lambda: {"count": 0, "total_us": 0.0, "longest_us": 0.0})
    by_thread: dict[str, float] = defaultdict(float)
    for s in mine:
        g = by_gen[int(s.args.get("generation", -1))]
        g["count"] += 1
        g["total_us"] += s.dur_us
        g["longest_us"] = max(g["longest_us"], s.dur_us)
        by_thread[s.thread] += s.dur_us
    longest = max(mine, key=lambda s: s.dur_us)
    return GCPauses(count=len(mine), total_us=total(merge((s.start_us, s.end_us) for s in mine)),
                    longest_us=longest.dur_us, longest_generation=int(longest.args.get("generation", -1)),
                    window_us=window[1] - window[0], by_generation=dict(by_gen), by_thread=dict(by_thread),
                    sites=_sites(mine))


def _sites(spans: list[Span], top: int = 3) -> list[dict[str, Any]]:
    """The collector's time by the code that began each collection (spans without the args left out)."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for s in spans:
        fn, where = s.args.get("function"), s.args.get("where")
        if isinstance(fn, str) and isinstance(where, str):
            a = acc[(fn, where)]
            a[0] += 1
            a[1] += s.dur_us
    spent = sum(s.dur_us for s in spans)
    rows = sorted(acc.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"function": fn, "where": where, "count": int(n), "us": us, "share": us / spent if spent > 0 else 0.0}
            for (fn, where), (n, us) in rows]
