"""The overlap matrix: how long each pair of span groups was active at the same time.

A group is a category (or span name) on one thread, its spans merged (intervals.py).
Case study B is read off this matrix: the ``transfer`` group of thread
``kv-transfer`` should run *during* ``ep.dispatch``/``ep.combine`` of the main thread;
0% overlap is the anomaly.

Pairs on the same thread are nesting (``model`` inside ``engine``), not concurrency,
so only cross-thread pairs are reported unless asked.

Per layer (``layer_overlap``, the matrix's ``layers``): a pipelined KV transfer (refstack's
``kv_transfer_granularity = layer``) sends layer i while the model computes layer i+1.
Spans that carry a ``layer`` arg say which layer they move or compute, so for each layer
the report gives its transfer time and the part of it during which a later layer's compute
ran on another thread: the overlap the pipeline exists for.  A sweep line over every
group's merged intervals gives all pairs in one pass: between two consecutive
boundaries the set of active groups is constant, and each active pair gains that time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from infra_agent.trace.intervals import (
    Interval,
    clip,
    intersect,
    merge,
    merged_by_group,
    total,
)
from infra_agent.trace.model import Span


@dataclass
class OverlapPair:
    a: str  # "cat@thread"
    b: str
    both_us: float
    share_of_a: float  # both / active time of a
    share_of_b: float

    def to_dict(self) -> dict[str, float | str]:
        return {"a": self.a, "b": self.b, "both_us": self.both_us, "share_of_a": self.share_of_a,
                "share_of_b": self.share_of_b}


# Span categories of a model layer's compute (refstack: the mixer and the experts) and of KV movement.
LAYER_COMPUTE_CATS = ("kda", "attn", "moe")
TRANSFER_CAT = "kv"


@dataclass
class LayerOverlap:
    layer: int
    transfer_us: float  # the layer's transfer spans, merged
    overlap_us: float  # of which a later layer's compute ran on another thread
    threads: list[str] = field(default_factory=list)  # where the transfer ran

    @property
    def share(self) -> float:
        return self.overlap_us / self.transfer_us if self.transfer_us else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"layer": self.layer, "transfer_us": self.transfer_us, "overlap_us": self.overlap_us,
                "share": self.share, "threads": self.threads}


@dataclass
class OverlapMatrix:
    by: str
    groups: dict[str, float] = field(default_factory=dict)  # label -> active µs
    threads: dict[str, str] = field(default_factory=dict)  # label -> thread
    pairs: list[OverlapPair] = field(default_factory=list)
    note: str = ""  # why the matrix is empty, when it is
    layers: list[LayerOverlap] = field(default_factory=list)  # per-layer transfer beside later compute

    def pair(self, a: str, b: str) -> OverlapPair | None:
        for p in self.pairs:
            if (p.a, p.b) == (a, b):
                return p
            if (p.a, p.b) == (b, a):
                return OverlapPair(a, b, p.both_us, p.share_of_b, p.share_of_a)
        return None

    def to_dict(self) -> dict[str, object]:
        return {"by": self.by, "groups": self.groups, "threads": self.threads, "note": self.note,
                "pairs": [p.to_dict() for p in self.pairs], "layers": [x.to_dict() for x in self.layers]}


def label(group: str, thread: str) -> str:
    return f"{group}@{thread}"


def overlap_matrix(spans: list[Span], by: str = "cat", window: Interval | None = None,
                   same_thread: bool = False) -> OverlapMatrix:
    """Overlap of every pair of (group, thread)s, by a sweep line over merged intervals."""
    merged = merged_by_group(spans, by)
    if window is not None:
        merged = {k: clip(v, window) for k, v in merged.items()}
        merged = {k: v for k, v in merged.items() if v}
    result = OverlapMatrix(by=by, layers=layer_overlap(spans, window))
    for (group, thread), ivs in merged.items():
        result.groups[label(group, thread)] = total(ivs)
        result.threads[label(group, thread)] = thread
    threads = {t for _, t in merged}
    if len(threads) < 2 and not same_thread:
        result.note = (f"no cross-thread overlap to measure: every span is on one thread ({next(iter(threads))})"
                       if threads else "no spans")
        return result
    # boundaries: (time, +1 opens / -1 closes, label); closes sort before opens at a tie,
    # so touching intervals do not count as overlapping
    events: list[tuple[float, int, str]] = []
    for (group, thread), ivs in merged.items():
        name = label(group, thread)
        for s, e in ivs:
            events.append((s, 1, name))
            events.append((e, -1, name))
    events.sort(key=lambda ev: (ev[0], ev[1]))
    both: dict[tuple[str, str], float] = defaultdict(float)
    active: list[str] = []
    prev_t = events[0][0] if events else 0.0
    for t, delta, name in events:
        dt = t - prev_t
        if dt > 0 and len(active) > 1:
            ordered = sorted(active)
            for i, a in enumerate(ordered):
                for b in ordered[i + 1:]:
                    if same_thread or result.threads[a] != result.threads[b]:
                        both[(a, b)] += dt
        prev_t = t
        if delta > 0:
            active.append(name)
        else:
            active.remove(name)
    for (a, b), us in sorted(both.items(), key=lambda kv: -kv[1]):
        ga, gb = result.groups[a], result.groups[b]
        result.pairs.append(OverlapPair(a, b, us, us / ga if ga else 0.0, us / gb if gb else 0.0))
    if not result.pairs:
        result.note = "no two groups on different threads were ever active at the same time"
    return result


def overlap_between(spans: list[Span], a: set[str], b: set[str], by: str = "name") -> tuple[float, float, float, float]:
    """(µs of ``a``, µs of ``b``, µs both, share of ``a`` overlapped): ``a`` and ``b`` are
    sets of names (or categories), unioned over their threads, counted only across threads."""
    a_by_thread: dict[str, list[Interval]] = defaultdict(list)
    b_by_thread: dict[str, list[Interval]] = defaultdict(list)
    for s in spans:
        key = s.name if by == "name" else (s.cat or s.name)
        if key in a:
            a_by_thread[s.thread].append((s.start_us, s.end_us))
        if key in b:
            b_by_thread[s.thread].append((s.start_us, s.end_us))
    a_all = merge(iv for ivs in a_by_thread.values() for iv in ivs)
    b_all = merge(iv for ivs in b_by_thread.values() for iv in ivs)
    both_ivs: list[Interval] = []
    for ta, ivs_a in a_by_thread.items():
        for tb, ivs_b in b_by_thread.items():
            if ta != tb:
                both_ivs += intersect(merge(ivs_a), merge(ivs_b))
    both = total(merge(both_ivs))
    ta_us, tb_us = total(a_all), total(b_all)
    return ta_us, tb_us, both, (both / ta_us if ta_us else 0.0)


def _layer(s: Span) -> int | None:
    v = s.args.get("layer") if s.args else None
    return v if isinstance(v, int) and v >= 0 else None


def layer_overlap(spans: list[Span], window: Interval | None = None) -> list[LayerOverlap]:
    """Per layer L: the transfer spans of L (category ``kv`` with a ``layer`` arg, on a thread
    that computes no layer) and how much of them a compute span of a layer > L (categories
    ``LAYER_COMPUTE_CATS`` with a ``layer`` arg) covered on another thread."""
    compute = [s for s in spans if s.cat in LAYER_COMPUTE_CATS and _layer(s) is not None]
    computing = {s.thread for s in compute}
    moved: dict[int, list[Span]] = defaultdict(list)
    for s in spans:
        layer = _layer(s)
        if s.cat == TRANSFER_CAT and layer is not None and s.thread not in computing:
            moved[layer].append(s)
    out: list[LayerOverlap] = []
    for layer in sorted(moved):
        ivs = merge((s.start_us, s.end_us) for s in moved[layer])
        later = merge((s.start_us, s.end_us) for s in compute if (_layer(s) or 0) > layer)
        if window is not None:
            ivs, later = clip(ivs, window), clip(later, window)
        out.append(LayerOverlap(layer, total(ivs), total(intersect(ivs, later)),
                                sorted({s.thread for s in moved[layer]})))
    return out
