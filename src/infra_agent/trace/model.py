"""The in-memory timeline: spans, instants and stack samples on one clock.

Every loader (ours, py-spy, Kineto) produces these, with times already mapped onto the
timeline's clock: microseconds since ``Timeline.origin_unix_ns`` (a unix time).  One
clock is what lets a py-spy sample be placed inside a span recorded by another tool.

Plain dataclasses, not pydantic: a refstack trace holds hundreds of thousands of
spans, and validation per span would cost more than the analysis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Where an event came from; a merged timeline keeps them apart in its tracks.
SOURCE_SPANS = "spans"
SOURCE_PYSPY = "py-spy"
SOURCE_KINETO = "kineto"
# Slack when asking whether one span ends before the next starts: a span that ends where
# the next begins (the engine's contiguous step phases) may end a float step after it
# once written and read as µs.  One nanosecond: below any clock here, above that rounding.
NS_SLACK_US = 1e-3


@dataclass(frozen=True)
class ThreadKey:
    """A thread as (source, pid, tid): tids of different tools are different numbers."""

    source: str
    pid: int
    tid: int


@dataclass
class Span:
    name: str
    cat: str
    thread: str  # the thread's display name ("engine-loop", "MainThread", "tid 123")
    start_us: float
    end_us: float
    args: dict[str, Any] = field(default_factory=dict)
    tid: int = 0
    pid: int = 0
    source: str = SOURCE_SPANS

    @property
    def dur_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class Instant:
    name: str
    cat: str
    thread: str
    ts_us: float
    args: dict[str, Any] = field(default_factory=dict)
    tid: int = 0
    pid: int = 0


@dataclass(frozen=True)
class Frame:
    name: str
    file: str
    line: int | None

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line is not None else self.file


@dataclass
class Sample:
    """One observation of one thread's Python stack (innermost frame last).

    From py-spy ``--gil``: the thread held the GIL at ``ts_us``.  ``idle`` is set when
    the source says the thread was idle (py-spy's chrometrace output does not say).
    """

    ts_us: float
    thread: str
    frames: tuple[Frame, ...]
    tid: int = 0
    holds_gil: bool = True
    idle: bool = False
    # True for a py-spy dump: every thread at this ts is listed, holder or not
    snapshot: bool = False

    @property
    def leaf(self) -> Frame | None:
        return self.frames[-1] if self.frames else None


@dataclass
class Timeline:
    """Everything loaded, on one clock (µs since ``origin_unix_ns``)."""

    origin_unix_ns: int | None = None
    spans: list[Span] = field(default_factory=list)
    instants: list[Instant] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # The interval py-spy was sampling, on the timeline clock (None without py-spy).
    sampled_window: tuple[float, float] | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def window(self) -> tuple[float, float]:
        """First start to last end over spans and instants (0, 0 when empty)."""
        starts = [s.start_us for s in self.spans] + [i.ts_us for i in self.instants]
        ends = [s.end_us for s in self.spans] + [i.ts_us for i in self.instants]
        if not starts:
            return (0.0, 0.0)
        return (min(starts), max(ends))

    def threads(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.spans:
            seen.setdefault(s.thread, None)
        return list(seen)

    def span_sources(self) -> list[Span]:
        """Spans from our tracer only (Kineto ops are kept apart from thread analysis)."""
        return [s for s in self.spans if s.source == SOURCE_SPANS]

    def gpu_spans(self) -> list[Span]:
        """A Kineto trace's device activity (kernels, copies, sets on ``stream N`` tracks):
        the GPU side of the timeline, which the overlap matrix and the thread table take
        beside our spans (its host ``cpu_op`` events stay out: our spans say what they do)."""
        from infra_agent.trace.gpu import GPU_CATS

        return [s for s in self.spans if s.source == SOURCE_KINETO and s.cat in GPU_CATS]


def snapshot_bounds(times: list[float], window: tuple[float, float]) -> list[tuple[float, float]]:
    """The stretch each snapshot stands for: up to the midpoints with its neighbours, the window's
    ends for the first and the last (empty when a snapshot lies outside the window: lo >= hi)."""
    out = []
    for i, t in enumerate(times):
        lo = window[0] if i == 0 else (times[i - 1] + t) / 2
        hi = window[1] if i + 1 == len(times) else (t + times[i + 1]) / 2
        out.append((lo, hi))
    return out


def snapshot_weights(times: list[float], window: tuple[float, float]) -> list[float]:
    """The time each snapshot stands for (:func:`snapshot_bounds`), clipped to ``window``."""
    return [max(hi - lo, 0.0) for lo, hi in snapshot_bounds(times, window)]
