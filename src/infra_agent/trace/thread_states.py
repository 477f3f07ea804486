"""Every thread, every state: what each sampled thread did through the window.

From py-spy dump snapshots (``PySpyDumpSampler``), each of which lists every thread of
the process with ``owns_gil``, ``active`` and its stack, every sample of every thread
is put in one state:

- ``running``: it owns the GIL (also when py-spy calls it idle: a native call that
  sleeps without releasing the GIL still keeps every other thread out);
- ``native``: on a CPU without the GIL (native code that released it);
- ``gil_wait``: parked, in no known blocking call, while another thread owns the GIL:
  waiting for the GIL;
- ``blocked:KIND``: parked off the GIL in a blocking call (``lock``, ``queue``,
  ``socket``, ``sleep``, ``subprocess``; ``other`` when parked in no known call while
  no thread owns the GIL), with its call site (:mod:`infra_agent.trace.blocking_calls`);
- ``idle``: the thread's normal rest: an event loop in its selector, a worker waiting
  for work at its outer loop.  An event-loop thread parked anywhere else is blocked:
  every request it serves waits with it.

Each snapshot stands for the time up to the midpoints with its neighbours (as for the
GIL holder, gil.py), so a thread's shares are fractions of the time it was sampled.
Per thread: the shares by state, the top call sites of each state (function, file:line,
what it waited in), who ran meanwhile (the GIL owner of the same snapshots, else a
thread on a CPU) and, where the thread has spans, the span it was in.

Threads that serve requests get a ``role``: an event loop (asyncio's or uvloop's frames
on its stack), or a name like a tokenizer, detokenizer, input or output thread.
"""

from __future__ import annotations

import linecache
import re
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field

from infra_agent.trace.blocking_calls import (
    LOCK,
    OTHER,
    QUEUE,
    SOCKET,
    ReadLine,
    blocking_call,
    loop_waits_for_io,
    runs_event_loop,
)
from infra_agent.trace.lock_holders import LockBlocks
from infra_agent.trace.model import (
    Sample,
    Span,
    Timeline,
    snapshot_bounds,
    snapshot_weights,
)

RUNNING, NATIVE, GIL_WAIT, BLOCKED, IDLE = "running", "native", "gil_wait", "blocked", "idle"
STATE_TEXT = {RUNNING: "running with the GIL", NATIVE: "running off the GIL", GIL_WAIT: "waiting for the GIL",
              BLOCKED: "blocked off the GIL", IDLE: "idle (its normal wait)"}
EVENT_LOOP = "event loop"
# A thread named like one of these serves requests (vLLM, SGLang and refstack name theirs so).
SERVING_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"detok", re.I), "detokenizer"),
    (re.compile(r"tokeni[sz]", re.I), "tokenizer"),
    (re.compile(r"output", re.I), "output"),
    (re.compile(r"input", re.I), "input"),
    (re.compile(r"http|api[-_ ]?server|frontend", re.I), "http"),
)
_SPAN_LOOKBACK = 256  # spans walked back from a sample's time to find the innermost one around it


@dataclass(frozen=True)
class SampleState:
    state: str
    kind: str | None  # blocked/idle: lock, queue, socket, sleep, subprocess, other
    function: str
    where: str  # file:line of the call site (of the innermost frame when not parked in a call)
    waits_in: str | None = None  # the blocking function, e.g. "Queue.get", "time.sleep"

    @property
    def label(self) -> str:
        return f"{BLOCKED}:{self.kind}" if self.state == BLOCKED else self.state


@dataclass
class CallSite:
    label: str  # a state label: running, native, gil_wait, blocked:KIND, idle
    function: str
    where: str
    waits_in: str | None
    us: float
    share: float  # of the thread's sampled time
    samples: int
    # who ran while this thread was here: {"thread", "function", "where", "how", "share"}
    meanwhile: dict[str, object] | None = None
    span: str | None = None  # the thread's innermost span during these samples, when it has spans
    # parked on a lock: the other thread seen inside a ``with LOCK:`` block meanwhile (lock_holders.py),
    # {"thread", "function", "where", "lock", "with_line", "share"}
    holder: dict[str, object] | None = None

    def to_dict(self) -> dict[str, object]:
        return {"label": self.label, "function": self.function, "where": self.where, "waits_in": self.waits_in,
                "us": self.us, "share": self.share, "samples": self.samples, "meanwhile": self.meanwhile,
                "span": self.span, "holder": self.holder}


@dataclass
class ThreadStates:
    thread: str
    role: str | None  # "event loop", "tokenizer", ... for a thread that serves requests
    samples: int
    sampled_us: float
    shares: dict[str, float]  # label -> share of the thread's sampled time
    sites: list[CallSite] = field(default_factory=list)  # the top call sites of each state, largest first

    @property
    def blocked_share(self) -> float:
        return sum(v for k, v in self.shares.items() if k.startswith(BLOCKED + ":"))

    @property
    def own_share(self) -> float:
        """The thread's own time: the window less its normal wait (an event loop's selector)."""
        return max(0.0, 1.0 - self.shares.get(IDLE, 0.0))

    @property
    def own_blocked_share(self) -> float:
        """Blocked off the GIL, as a share of the thread's own time: what a loaded machine keeps.
        A server whose engine slows waits longer in its selector, which stretches the window and
        shrinks a fixed blocking call's share of it, not of the loop's own time."""
        own = self.own_share
        return self.blocked_share / own if own > 0 else 0.0

    def blocked_sites(self) -> list[CallSite]:
        return [s for s in self.sites if s.label.startswith(BLOCKED + ":")]

    def to_dict(self) -> dict[str, object]:
        return {"thread": self.thread, "role": self.role, "samples": self.samples, "sampled_us": self.sampled_us,
                "shares": self.shares, "blocked_share": self.blocked_share,
                "own_blocked_share": self.own_blocked_share, "sites": [s.to_dict() for s in self.sites]}


@dataclass
class ThreadStatesReport:
    snapshots: int
    threads: list[ThreadStates] = field(default_factory=list)
    note: str | None = None  # why there are no states, when there are samples but none to classify

    def thread(self, name: str) -> ThreadStates | None:
        return next((t for t in self.threads if t.thread == name), None)

    def to_dict(self) -> dict[str, object]:
        return {"snapshots": self.snapshots, "threads": [t.to_dict() for t in self.threads], "note": self.note}


def classify(sample: Sample, owner: Sample | None, loop: bool, read_line: ReadLine | None = None) -> SampleState:
    """One thread's state in one snapshot; ``owner``: the thread owning the GIL then (None: nobody
    else), ``loop``: the thread runs an event loop."""
    leaf = sample.leaf
    fn, where = (leaf.name, leaf.where()) if leaf else ("?", "?")
    if sample.holds_gil:
        return SampleState(RUNNING, None, fn, where)
    if loop and loop_waits_for_io(sample.frames):
        return SampleState(IDLE, SOCKET, fn, where, "the event loop's selector")
    b = blocking_call(sample.frames, read_line)
    if b is not None:
        # An event loop has one rest, its selector; a worker rests waiting for work at its loop.
        rest = not loop and b.for_work and b.outer
        return SampleState(IDLE if rest else BLOCKED, b.kind, b.site.name, b.site.where(), b.waits_in)
    if not sample.idle:
        return SampleState(NATIVE, None, fn, where)
    if owner is not None:
        return SampleState(GIL_WAIT, None, fn, where)
    return SampleState(BLOCKED, OTHER, fn, where)


def role_of(thread: str, loop: bool) -> str | None:
    if loop:
        return EVENT_LOOP
    return next((role for pattern, role in SERVING_NAMES if pattern.search(thread)), None)


class _SpanIndex:
    """The innermost span of a thread around a time: the latest-starting one that contains it."""

    def __init__(self, spans: list[Span]) -> None:
        by: dict[str, list[Span]] = defaultdict(list)
        for s in spans:
            by[s.thread].append(s)
        self.spans = {t: sorted(v, key=lambda s: s.start_us) for t, v in by.items()}
        self.starts = {t: [s.start_us for s in v] for t, v in self.spans.items()}

    def innermost(self, thread: str, ts: float) -> str | None:
        spans = self.spans.get(thread)
        if not spans:
            return None
        i = bisect_right(self.starts[thread], ts) - 1
        for j in range(i, max(i - _SPAN_LOOKBACK, -1), -1):
            if spans[j].end_us >= ts:
                return spans[j].name
        return None


def _fresh_lines() -> ReadLine:
    """Source lines as the files are now: a long-lived process (the MCP server) may analyse
    a file edited since it last read it, so each file's cache is checked once per analysis."""
    checked: set[str] = set()

    def read(file: str, line: int) -> str:
        if file not in checked:
            checked.add(file)
            linecache.checkcache(file)
        return linecache.getline(file, line)

    return read


def _meanwhile(sample: Sample, group: list[Sample], owner: Sample | None) -> tuple[str, str, str, str] | None:
    """Who ran while ``sample``'s thread did not: the GIL owner, else a thread on a CPU."""
    other = owner if owner is not None and owner.thread != sample.thread else None
    how = "held the GIL"
    if other is None:
        other = next((s for s in group if s.thread != sample.thread and not s.idle), None)
        how = "ran off the GIL"
    if other is None:
        return None
    leaf = other.leaf
    return (other.thread, leaf.name if leaf else "?", leaf.where() if leaf else "?", how)


def _top(counter: dict[tuple[str, str, str, str], float], denom: float) -> dict[str, object] | None:
    if not counter or denom <= 0:
        return None
    (thread, fn, where, how), us = max(counter.items(), key=lambda kv: kv[1])
    return {"thread": thread, "function": fn, "where": where, "how": how, "share": us / denom}


def _top_holder(counter: dict[tuple[str, str, str, str, int], float], denom: float) -> dict[str, object] | None:
    if not counter or denom <= 0:
        return None
    (thread, fn, where, lock, with_line), us = max(counter.items(), key=lambda kv: kv[1])
    return {"thread": thread, "function": fn, "where": where, "lock": lock, "with_line": with_line, "share": us / denom}


@dataclass
class _Acc:
    """One (thread, state, call site)'s time, and who ran and which span was open meanwhile."""

    us: float = 0.0
    n: int = 0
    meanwhile: dict[tuple[str, str, str, str], float] = field(default_factory=lambda: defaultdict(float))
    span: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    holders: dict[tuple[str, str, str, str, int], float] = field(default_factory=lambda: defaultdict(float))


SiteKey = tuple[str, str, str, str, "str | None"]  # thread, label, function, where, waits_in


def _snapshots(timeline: Timeline) -> tuple[dict[float, list[Sample]], list[float], set[str]] | None:
    """The dump snapshots by time (every thread at each), their times in order, and the threads
    that run an event loop; None without snapshots or a sampled window."""
    snaps = [s for s in timeline.samples if s.snapshot]
    if not snaps or timeline.sampled_window is None:
        return None
    by_ts: dict[float, list[Sample]] = defaultdict(list)
    for s in snaps:
        by_ts[s.ts_us].append(s)
    return by_ts, sorted(by_ts), {s.thread for s in snaps if runs_event_loop(s.frames)}


def thread_states(timeline: Timeline, read_line: ReadLine | None = None, top: int = 3) -> ThreadStatesReport:
    """Every dump-sampled thread's states over the sampled window (see the module docstring)."""
    grouped = _snapshots(timeline)
    if grouped is None:
        note = ("thread states need py-spy dump snapshots (every thread at each sample); a chrometrace recording "
                "keeps only the GIL holder") if timeline.samples else None
        return ThreadStatesReport(0, [], note)
    by_ts, times, loops = grouped
    read = read_line or _fresh_lines()
    spans = _SpanIndex(timeline.span_sources())
    seen: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # thread -> [samples, µs]
    per_label: dict[tuple[str, str], float] = defaultdict(float)
    sites: dict[SiteKey, _Acc] = defaultdict(_Acc)
    blocks = LockBlocks(lambda file: _source(read, file))
    for ts, w in zip(times, snapshot_weights(times, timeline.sampled_window), strict=True):
        group = by_ts[ts]
        owner = next((s for s in group if s.holds_gil), None)
        states = [classify(s, owner if owner is not None and owner.thread != s.thread else None, s.thread in loops,
                           read) for s in group]
        for s, st in zip(group, states, strict=True):
            seen[s.thread][0] += 1
            seen[s.thread][1] += w
            per_label[(s.thread, st.label)] += w
            acc = sites[(s.thread, st.label, st.function, st.where, st.waits_in)]
            acc.us += w
            acc.n += 1
            if st.state != RUNNING:
                who = _meanwhile(s, group, owner)
                if who is not None:
                    acc.meanwhile[who] += w
            span = spans.innermost(s.thread, ts)
            if span is not None:
                acc.span[span] += w
            if st.state == BLOCKED and st.kind == LOCK:
                for key in _holders(s, group, states, blocks):
                    acc.holders[key] += w
    return ThreadStatesReport(len(times), _per_thread(seen, per_label, sites, loops, top))


def gil_wait_intervals(timeline: Timeline, read_line: ReadLine | None = None) -> dict[str, list[tuple[float, float]]]:
    """Per thread, the stretches of the sampled window it spent waiting *for the GIL* (state
    ``gil_wait``: parked in no blocking call while another thread owned it), from dump snapshots
    (each standing for the time up to the midpoints with its neighbours); {} without snapshots."""
    grouped = _snapshots(timeline)
    if grouped is None or timeline.sampled_window is None:
        return {}
    by_ts, times, loops = grouped
    read = read_line or _fresh_lines()
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for ts, (lo, hi) in zip(times, snapshot_bounds(times, timeline.sampled_window), strict=True):
        group = by_ts[ts]
        owner = next((s for s in group if s.holds_gil), None)
        if owner is None or hi <= lo:
            continue
        for s in group:
            if s.thread != owner.thread and classify(s, owner, s.thread in loops, read).state == GIL_WAIT:
                out[s.thread].append((lo, hi))
    return dict(out)


def _source(read: ReadLine, file: str) -> str:
    """A whole file through ``read`` (line by line: "" past its end)."""
    lines, n = [], 1
    while text := read(file, n):
        lines.append(text)
        n += 1
    return "".join(lines)


def _holders(waiter: Sample, group: list[Sample], states: list[SampleState],
             blocks: LockBlocks) -> list[tuple[str, str, str, str, int]]:
    """The other threads of one snapshot inside a ``with LOCK:`` body while ``waiter`` is parked on a lock.
    A thread parked in a lock or queue wait, or at its rest, is no holder: a ``Condition.wait`` inside its
    ``with cond:`` block released the lock for the wait."""
    out = []
    for other, st in zip(group, states, strict=True):
        if other.thread == waiter.thread or st.state == IDLE or (st.state == BLOCKED and st.kind in (LOCK, QUEUE)):
            continue
        held = blocks.held(other.frames)
        if held is not None:
            out.append((other.thread, held.frame.name, held.frame.where(), held.lock, held.with_line))
    return out


def _per_thread(seen: dict[str, list[float]], per_label: dict[tuple[str, str], float], sites: dict[SiteKey, _Acc],
                loops: set[str], top: int) -> list[ThreadStates]:
    out: list[ThreadStates] = []
    for thread, (n, us) in seen.items():
        shares = {label: v / us if us else 0.0 for (t, label), v in sorted(per_label.items(), key=lambda kv: -kv[1])
                  if t == thread}
        mine: list[CallSite] = []
        for label in shares:
            rows = sorted(((k, a) for k, a in sites.items() if k[0] == thread and k[1] == label),
                          key=lambda ka: -ka[1].us)[:top]
            for (_, _, fn, where, waits_in), a in rows:
                mine.append(CallSite(label, fn, where, waits_in, a.us, a.us / us if us else 0.0, a.n,
                                     _top(a.meanwhile, a.us),
                                     max(a.span, key=a.span.__getitem__) if a.span else None,
                                     _top_holder(a.holders, a.us)))
        mine.sort(key=lambda c: -c.us)
        out.append(ThreadStates(thread, role_of(thread, thread in loops), int(n), us, shares, mine))
    out.sort(key=lambda t: (t.role is None, -t.blocked_share, t.thread))
    return out
