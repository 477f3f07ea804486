"""Clock alignment: each source's zero and unit, mapped onto the timeline's clock.

What each source uses (checked against the tools, not assumed):

- **our tracer** (``infra_agent.tracing``): ``ts``/``dur`` in µs since the tracer's
  ``time.perf_counter_ns()`` origin; ``otherData.clock_origin_unix_ns`` is
  ``time.time_ns()`` read at that same origin, so the unix time of a span is
  ``clock_origin_unix_ns + ts * 1000``.
- **PyTorch profiler / Kineto** (``export_chrome_trace``): ``ts``/``dur`` in µs since
  the top-level ``baseTimeNanoseconds`` (a unix time in ns); checked against
  ``time.time_ns()`` inside a ``record_function`` to within 0.3 ms (torch 2.13, CPU).
- **py-spy** (``--format chrometrace``): ``ts`` in µs of a monotonic clock (Rust
  ``Instant``) whose zero is py-spy's start of recording; the file holds *no* absolute
  anchor.  The anchor is either given (``start_unix_ns``: the unix time at which py-spy
  printed "Sampling process ..."), or estimated as the file's modification time minus
  its last ``ts`` (py-spy closes every open frame with ``ts = now`` right before it
  writes the file), which is good to a few ms for small files.

The timeline's zero is the first span trace's origin; everything else is shifted onto
it.  ``offset_us`` on a :class:`SourceClock` is the manual correction the CLI exposes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceClock:
    """How one source's ``ts`` maps to unix time: ``zero_unix_ns + ts * unit_ns``."""

    zero_unix_ns: int | None  # None: the file gives no anchor (the source floats)
    unit_ns: float = 1000.0  # Chrome trace ts is µs
    how: str = ""  # one line for the report: where the zero came from
    offset_us: float = 0.0

    def to_timeline_us(self, ts: float, timeline_origin_unix_ns: int | None) -> float:
        """``ts`` of this source on the timeline clock (µs since the timeline's zero)."""
        local_us = ts * self.unit_ns / 1000.0 + self.offset_us
        if self.zero_unix_ns is None or timeline_origin_unix_ns is None:
            return local_us
        return local_us + (self.zero_unix_ns - timeline_origin_unix_ns) / 1000.0

    def describe(self) -> dict[str, object]:
        return {"zero_unix_ns": self.zero_unix_ns, "unit_ns": self.unit_ns, "how": self.how, "offset_us": self.offset_us}
