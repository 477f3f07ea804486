"""Event-loop stalls: how long an asyncio loop's thread stays away from its selector.

An asyncio server serves every request from one thread.  Between two waits in its
selector the loop runs callbacks; while it does, no other request on it makes progress:
a chunk ready to stream waits, a new connection waits.  Each such stretch is a
**stall**.  Most are short (a callback or two); a blocking call on the loop (a
``time.sleep``, a synchronous HTTP call, a lock) or a long computation makes a long one,
and every request in flight waits that long.

The input is ``py-spy record --idle --format chrometrace`` at a few hundred Hz, without
``--gil`` (a loop parked in ``time.sleep`` holds no GIL and would leave no sample).  That
format emits events only when a thread's stack changes (pyspy.py), which is just what
stalls need: the loop thread's stack leaves the selector (the stall begins) and comes back
to it (the stall ends), each at a sample's time.  So it works on any Python asyncio
server, ours or not.  Its resolution is the sampling interval: a stall shorter than one
interval may go unseen, a stall is measured to about one interval, and two stalls with a
selector wait shorter than an interval between them read as one.

A stall's **call site** is where the loop spent most of the stall: the blocking call's
site when it was parked in one (:mod:`infra_agent.trace.blocking_calls`), else the
innermost frame outside asyncio's and the standard library's own code.  The sites of the
longest stalls (at or above the window's p90 stall) are ranked by their stall time.

Stalls are lined up with the requests of the same window (``start_times``, unix seconds,
in a serving result, serving/metrics.py): the share of the tail requests' TTFT (and of
the tail inter-token gaps) that the loop spent stalled is the share of that tail the
stalls explain.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra_agent.trace.blocking_calls import (
    SLEEP,
    blocking_call,
    loop_waits_for_io,
    runs_event_loop,
)
from infra_agent.trace.intervals import Interval, merge
from infra_agent.trace.model import Frame, Sample, Timeline

TAIL_SITE_PCT = 90.0  # the stalls at or above this percentile of their window give the named call sites


@dataclass(frozen=True)
class StallSite:
    function: str
    where: str  # file:line
    kind: str  # a blocking call's kind (sleep, lock, queue, socket, subprocess), or "running"
    waits_in: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {"function": self.function, "where": self.where, "kind": self.kind, "waits_in": self.waits_in}


@dataclass
class Stall:
    start_us: float  # µs since the recording's zero (unix ``LoopStalls.zero_unix_ns``)
    end_us: float
    site: StallSite | None

    @property
    def ms(self) -> float:
        return (self.end_us - self.start_us) / 1e3


@dataclass
class LoopStalls:
    thread: str
    zero_unix_ns: int | None  # the recording's zero; None: not aligned to unix time
    window_us: tuple[float, float]  # the sampled window
    interval_ms: float  # the sampling interval: the resolution of every stall
    stalls: list[Stall] = field(default_factory=list)
    # Stalled time (µs) by where the loop was, over every stall: a stall that joins several
    # callbacks counts each at its own site.
    site_us: dict[StallSite | None, float] = field(default_factory=dict)
    # (start µs, end µs, site): each stretch between two stack changes inside a stall
    segments: list[tuple[float, float, StallSite | None]] = field(default_factory=list)

    def durations_ms(self) -> list[float]:
        return [s.ms for s in self.stalls]

    def pct(self, q: float) -> float:
        import numpy as np

        d = self.durations_ms()
        return float(np.percentile(d, q)) if d else 0.0

    @property
    def stalled_share(self) -> float:
        span = self.window_us[1] - self.window_us[0]
        return sum(s.end_us - s.start_us for s in self.stalls) / span if span > 0 else 0.0

    def intervals_unix_s(self, site: StallSite | None = None) -> list[Interval]:
        """The stalls (``site``: the stretches of them spent there) as merged unix-second intervals;
        empty when the recording is not aligned to unix time."""
        if self.zero_unix_ns is None:
            return []
        z = self.zero_unix_ns / 1e9
        if site is None:
            return merge([(z + s.start_us / 1e6, z + s.end_us / 1e6) for s in self.stalls])
        return merge([(z + a / 1e6, z + b / 1e6) for a, b, at in self.segments if at == site])

    def top_time_site(self) -> StallSite | None:
        return max(self.site_us, key=self.site_us.__getitem__) if self.site_us else None

    def top_sites(self, n: int = 5) -> list[dict[str, object]]:
        """The call sites of the stalls at or above the window's p90 stall, by their stall time."""
        if not self.stalls:
            return []
        floor = self.pct(TAIL_SITE_PCT)
        long = [s for s in self.stalls if s.ms >= floor]
        acc: dict[StallSite | None, list[float]] = defaultdict(list)
        for s in long:
            acc[s.site].append(s.ms)
        all_ms = sum(s.ms for s in long)
        rows = [{**(site.to_dict() if site else {"function": "?", "where": "?", "kind": "?", "waits_in": None}),
                 "stalls": len(v), "total_ms": sum(v), "max_ms": max(v), "share_of_long": sum(v) / all_ms if all_ms else 0.0}
                for site, v in acc.items()]
        return sorted(rows, key=lambda r: -float(r["total_ms"]))[:n]  # type: ignore[arg-type]

    def time_sites(self, n: int = 5) -> list[dict[str, object]]:
        """Where the stalled time went, over every stall, largest first, with its share of it."""
        whole = sum(self.site_us.values())
        rows = [{**(site.to_dict() if site else {"function": "?", "where": "?", "kind": "?", "waits_in": None}),
                 "ms": us / 1e3, "share": us / whole if whole else 0.0} for site, us in self.site_us.items()]
        return sorted(rows, key=lambda r: -float(r["ms"]))[:n]  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return {"thread": self.thread, "stalls": len(self.stalls), "interval_ms": self.interval_ms,
                "p50_ms": self.pct(50), "p99_ms": self.pct(99), "max_ms": self.pct(100),
                "stalled_share": self.stalled_share, "top_sites": self.top_sites(), "time_sites": self.time_sites()}


def _stdlib(frame: Frame) -> bool:
    path = frame.file.replace("\\", "/")
    return "/lib/python" in path and "-packages/" not in path


def _third_party(frame: Frame) -> bool:
    return "-packages/" in frame.file.replace("\\", "/")


def _site(frames: tuple[Frame, ...]) -> StallSite | None:
    """Where a loop thread away from its selector is: a blocking call's site, else the innermost
    frame of the callback it runs (the frames inside ``_run_once``) that is the server's own code,
    else the innermost one outside the standard library (a web framework's), else the innermost."""
    b = blocking_call(frames)
    if b is not None and b.kind == SLEEP and any(f.file.replace("\\", "/").endswith("/asyncio/tasks.py") for f in frames):
        b = None  # asyncio.sleep's own body running (it schedules a timer and returns): no blocking call
    if b is not None:
        return StallSite(b.site.name, b.site.where(), b.kind, b.waits_in)
    if not frames:
        return None
    # The callback's frames: those inside the loop's _run_once (all of them when a read cut
    # the stack short and it is missing), so the frames that started the loop never count.
    runs = [i for i, f in enumerate(frames) if f.name.rsplit(".", 1)[-1] == "_run_once"
            and f.file.replace("\\", "/").endswith("/asyncio/base_events.py")]
    callback = frames[runs[-1] + 1:] if runs else frames
    for keep in (lambda f: not _stdlib(f) and not _third_party(f), lambda f: not _stdlib(f)):
        for f in reversed(callback):
            if keep(f):
                return StallSite(f.name, f.where(), "running")
    leaf = frames[-1]
    return StallSite(leaf.name, leaf.where(), "running")


def stalls_of(samples: list[Sample], thread: str, window: tuple[float, float], interval_ms: float,
              zero_unix_ns: int | None) -> LoopStalls:
    """The stalls of one loop thread from its stack changes (samples sorted by time)."""
    mine = [s for s in samples if s.thread == thread]
    out = LoopStalls(thread, zero_unix_ns, window, interval_ms)
    start: float | None = None
    held: dict[StallSite | None, float] = defaultdict(float)
    for i, s in enumerate(mine):
        if loop_waits_for_io(s.frames):
            if start is not None:
                out.stalls.append(Stall(start, s.ts_us, max(held, key=held.__getitem__) if held else None))
                start = None
            continue
        if start is None:
            start, held = s.ts_us, defaultdict(float)
        nxt = mine[i + 1].ts_us if i + 1 < len(mine) else window[1]
        site = _site(s.frames)
        held[site] += nxt - s.ts_us
        out.site_us[site] = out.site_us.get(site, 0.0) + nxt - s.ts_us
        out.segments.append((s.ts_us, nxt, site))
    if start is not None and window[1] > start:
        # Away from its selector until the recording ended: a stall as long as we saw it.
        out.stalls.append(Stall(start, window[1], max(held, key=held.__getitem__) if held else None))
    return out


def loop_stalls(path: Path, start_unix_ns: int | None, rate_hz: float) -> list[LoopStalls]:
    """Every event-loop thread's stalls in a ``py-spy record --idle`` chrometrace, busiest first."""
    from infra_agent.trace.pyspy import add_recording

    tl = Timeline()
    events = json.loads(Path(path).read_text() or "[]")
    add_recording(tl, events, Path(path), {}, start_unix_ns=start_unix_ns, gil=False)
    if tl.sampled_window is None:
        return []
    loops = sorted({s.thread for s in tl.samples if runs_event_loop(s.frames)})
    out = [stalls_of(tl.samples, t, tl.sampled_window, 1e3 / rate_hz, tl.origin_unix_ns) for t in loops]
    return sorted(out, key=lambda ls: -ls.stalled_share)


@dataclass
class TailShare:
    metric: str  # ttft or itl
    pct: float  # the tail: at or above this percentile
    threshold_ms: float
    count: int  # requests (ttft) or gaps (itl) in the tail
    stalled_share: float  # of the tail's time, the share the loop was stalled
    rest_share: float  # the same for the rest (below the percentile): what is usual

    def to_dict(self) -> dict[str, object]:
        return {"metric": self.metric, "pct": self.pct, "threshold_ms": self.threshold_ms, "count": self.count,
                "stalled_share": self.stalled_share, "rest_share": self.rest_share}


def covered(ivs: list[Interval], stalls: list[Interval]) -> tuple[float, float]:
    """(stalled time inside the intervals, each counted on its own, their whole length); ``stalls`` merged."""
    import numpy as np

    if not ivs:
        return 0.0, 0.0
    st = np.asarray([s for s, _ in stalls])
    en = np.asarray([e for _, e in stalls])
    before = np.concatenate([[0.0], np.cumsum(en - st)])  # stalled time before stall i starts

    def upto(t: Any) -> Any:  # stalled time up to t
        i = np.searchsorted(st, t, side="right")
        prev = np.maximum(i - 1, 0)
        inside = np.where(i > 0, np.clip(t - st[prev], 0.0, en[prev] - st[prev]), 0.0)
        return before[prev] * (i > 0) + inside

    lo = np.asarray([s for s, _ in ivs])
    hi = np.asarray([e for _, e in ivs])
    return float(np.sum(upto(hi) - upto(lo))), float(np.sum(hi - lo))


def tail_shares(result: dict[str, Any], stalls: list[Interval], pct: float = 90.0) -> list[TailShare]:
    """The share of the TTFT tail and of the ITL tail the loop spent stalled (``stalls``: merged
    unix-second intervals), beside the same share for the rest; from a serving result with
    ``start_times``.  Requests' own windows may overlap (concurrent requests): each counts its own."""
    import numpy as np

    starts, ttfts, itls = result.get("start_times"), result.get("ttfts"), result.get("itls")
    if not (isinstance(starts, list) and isinstance(ttfts, list) and stalls):
        return []
    errors = result.get("errors") or [None] * len(starts)
    reqs = [(float(s), float(t), list(map(float, g or []))) for s, t, g, e in
            zip(starts, ttfts, itls or [[]] * len(starts), errors, strict=False)
            if isinstance(s, (int, float)) and isinstance(t, (int, float)) and not e and t > 0]
    out: list[TailShare] = []
    first = [(s, s + t) for s, t, _ in reqs]
    gaps: list[Interval] = []
    for s, t, g in reqs:
        at = s + t
        for d in g:
            gaps.append((at, at + d))
            at += d
    for metric, ivs in (("ttft", first), ("itl", gaps)):
        if len(ivs) < 10:
            continue
        lens = np.asarray([e - s for s, e in ivs])
        cut = float(np.percentile(lens, pct))
        tail = [iv for iv, n in zip(ivs, lens, strict=True) if n >= cut]
        rest = [iv for iv, n in zip(ivs, lens, strict=True) if n < cut]
        t_cov, t_all = covered(tail, stalls)
        r_cov, r_all = covered(rest, stalls)
        out.append(TailShare(metric, pct, cut * 1e3, len(tail), t_cov / t_all if t_all else 0.0,
                             r_cov / r_all if r_all else 0.0))
    return out
