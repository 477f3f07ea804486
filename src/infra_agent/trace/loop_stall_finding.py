"""The ``loop_stalls`` finding: an event loop's stalls, lined up with the requests' tail.

From :mod:`infra_agent.trace.loop_stalls` (the stall distribution of each loop thread)
and the window's serving result (``start_times``, ``ttfts``, ``itls``): for the TTFT
tail (the requests at or above the window's p90 TTFT) and the ITL tail (the gaps at or
above the p90 gap), the share of that tail's time during which the loop was stalled in
a long stall, beside the same share for the rest.

A warning when long stalls explain a share of a tail: the loop spent at least
``TAIL_SHARE_MIN`` of the tail's time in stalls of ``LONG_STALL_INTERVALS`` sampling
intervals or more, and the tail saw more of them than the rest did
(``TAIL_OVER_REST``), i.e. the stalls are where the tail comes from, not a constant
background.  Only long stalls count: a loop that serves a busy server leaves its
selector for a sample or two all the time, and that is its work, not a stall.  The
location is the call site of the longest stalls.  Otherwise the distribution is info.
"""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Finding, Location, Measurement
from infra_agent.trace.loop_stalls import LoopStalls, tail_shares
from infra_agent.vocabulary import FindingKind

LONG_STALL_INTERVALS = 3  # a stall of this many sampling intervals or more is long (one or two: the loop's work)
TAIL_SHARE_MIN = 0.25  # of a tail's time spent in long stalls
TAIL_OVER_REST = 1.25  # the tail's share over the rest's


def _split(where: str) -> tuple[str | None, int | None]:
    file, _, line = where.rpartition(":")
    return (file, int(line)) if file and line.isdigit() else ((where if where != "?" else None), None)


def _long(ls: LoopStalls) -> list[tuple[float, float]]:
    floor_ms = LONG_STALL_INTERVALS * ls.interval_ms
    if ls.zero_unix_ns is None:
        return []
    z = ls.zero_unix_ns / 1e9
    return [(z + s.start_us / 1e6, z + s.end_us / 1e6) for s in ls.stalls if s.ms >= floor_ms]


def loop_stall_feedback(loops: list[LoopStalls], result: dict[str, Any] | None,
                        tags: dict[str, str]) -> tuple[list[Finding], list[Measurement], list[dict[str, object]]]:
    """Findings, measurements (``loop_stall_ms`` per loop thread) and a summary per loop thread."""
    from infra_agent.trace.intervals import merge

    findings: list[Finding] = []
    measurements: list[Measurement] = []
    summary: list[dict[str, object]] = []
    for ls in loops:
        if not ls.stalls:
            continue
        measurements.append(Measurement.from_samples("loop_stall_ms", "ms", ls.durations_ms(), "lower",
                                                     thread=ls.thread, component="server", **tags))
        tails = tail_shares(result, merge(_long(ls))) if result else []
        d = {**ls.to_dict(), "tails": [t.to_dict() for t in tails]}
        summary.append(d)
        sites = ls.top_sites()
        top = sites[0] if sites else None
        dist = (f"event loop {ls.thread}: {len(ls.stalls)} stalls away from its selector, p50 {ls.pct(50):.1f} ms, "
                f"p99 {ls.pct(99):.1f} ms, max {ls.pct(100):.1f} ms ({100 * ls.stalled_share:.0f}% of the window, "
                f"sampled every {ls.interval_ms:.1f} ms)")
        if top is not None:
            dist += (f"; the longest stalls (>= p90) are {100 * float(top['share_of_long']):.0f}% at {top['function']} "  # type: ignore[arg-type]
                     f"({top['where']}, {top['kind']}{' in ' + str(top['waits_in']) if top['waits_in'] else ''})")
        explains = [t for t in tails if t.stalled_share >= TAIL_SHARE_MIN
                    and t.stalled_share >= TAIL_OVER_REST * t.rest_share]
        file, line = _split(str(top["where"])) if top else (None, None)
        loc = Location(file=file, line=line, function=str(top["function"]) if top else None, thread=ls.thread,
                       component="server")
        evidence: dict[str, Any] = {**d, "long_stall_ms": LONG_STALL_INTERVALS * ls.interval_ms}
        if not explains:
            findings.append(Finding(kind=FindingKind.LOOP_STALLS, severity="info", message=dist, location=loc,
                                    evidence=evidence))
            continue
        best = max(explains, key=lambda t: t.stalled_share)
        what = "TTFT" if best.metric == "ttft" else "inter-token gaps"
        msg = (f"{dist}: stalls of {LONG_STALL_INTERVALS * ls.interval_ms:.0f} ms or more explain "
               f"{100 * best.stalled_share:.0f}% of the {what} tail (the {best.count} "
               f"{'requests' if best.metric == 'ttft' else 'gaps'} at or above p{best.pct:g}, "
               f"{best.threshold_ms:.1f} ms) against {100 * best.rest_share:.0f}% of the rest")
        evidence.update({"explains": best.metric, "tail_share": best.stalled_share, "rest_share": best.rest_share})
        call = top["waits_in"] or top["function"] if top else "?"
        findings.append(Finding(
            kind=FindingKind.LOOP_STALLS, severity="warning", message=msg, location=loc, evidence=evidence,
            next_question=(f"Why does the event loop stay in {call} at {top['where'] if top else '?'}? Every request "
                           "on the loop waits that long: await an async equivalent, or move the work off the loop "
                           "(loop.run_in_executor, asyncio.to_thread).")))
    return findings, measurements, summary
