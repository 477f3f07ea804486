"""The ``loop_stalls`` finding: an event loop's stalls, lined up with the requests' tail.

From :mod:`infra_agent.trace.loop_stalls` (the stall distribution of each loop thread and
where its stalled time went) and the window's serving result (``start_times``, ``ttfts``,
``itls``): for the TTFT tail (the requests at or above the window's p90 TTFT) and the ITL
tail (the gaps at or above the p90 gap), the share of that tail's time during which the
loop was stalled, beside the same share for the rest.

A **warning** when a blocking call on the loop explains a share of a tail: the call site
where the loop spent most of its stalled time is a blocking call (a sleep, a lock, a
socket, a queue, a subprocess) and the loop sat in it for at least ``TAIL_SHARE_MIN`` of
the TTFT or the ITL tail's time.  A loop that runs Python all the time is its own work (or
a machine short of CPU: a sampled stack cannot tell a callback from a thread waiting for a
core), so it is reported as the distribution (info), with the tail shares and the sites.
"""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Finding, Location, Measurement
from infra_agent.trace.loop_stalls import LoopStalls, tail_shares
from infra_agent.vocabulary import FindingKind

TAIL_SHARE_MIN = 0.1  # of a tail's time the loop spent in the one blocking call


def _split(where: str) -> tuple[str | None, int | None]:
    file, _, line = where.rpartition(":")
    return (file, int(line)) if file and line.isdigit() else ((where if where != "?" else None), None)


def loop_stall_feedback(loops: list[LoopStalls], result: dict[str, Any] | None,
                        tags: dict[str, str]) -> tuple[list[Finding], list[Measurement], list[dict[str, object]]]:
    """Findings, measurements (``loop_stall_ms`` per loop thread) and a summary per loop thread."""
    findings: list[Finding] = []
    measurements: list[Measurement] = []
    summary: list[dict[str, object]] = []
    for ls in loops:
        if not ls.stalls:
            continue
        measurements.append(Measurement.from_samples("loop_stall_ms", "ms", ls.durations_ms(), "lower",
                                                     thread=ls.thread, component="server", **tags))
        tails = tail_shares(result, ls.intervals_unix_s()) if result else []
        site = ls.top_time_site()
        at_site = tail_shares(result, ls.intervals_unix_s(site)) if result and site is not None else []
        d = {**ls.to_dict(), "tails": [t.to_dict() for t in tails], "site_tails": [t.to_dict() for t in at_site]}
        summary.append(d)
        dist = (f"event loop {ls.thread}: {len(ls.stalls)} stalls away from its selector, p50 {ls.pct(50):.1f} ms, "
                f"p99 {ls.pct(99):.1f} ms, max {ls.pct(100):.1f} ms ({100 * ls.stalled_share:.0f}% of the window, "
                f"sampled every {ls.interval_ms:.1f} ms)")
        share = ls.site_us.get(site, 0.0) / sum(ls.site_us.values()) if site is not None else 0.0
        if site is not None:
            dist += (f"; {100 * share:.0f}% of the stalled time at {site.function} ({site.where}, {site.kind}"
                     f"{' in ' + site.waits_in if site.waits_in else ''})")
        dist += "".join(f"; stalled during {100 * t.stalled_share:.0f}% of the {t.metric.upper()} tail (>= p{t.pct:g}, "
                        f"{t.threshold_ms:.1f} ms) against {100 * t.rest_share:.0f}% of the rest" for t in tails)
        file, line = _split(site.where) if site else (None, None)
        loc = Location(file=file, line=line, function=site.function if site else None, thread=ls.thread,
                       component="server")
        evidence: dict[str, Any] = {**d, "site": site.to_dict() if site else None, "site_share": share}
        explains = [t for t in at_site if t.stalled_share >= TAIL_SHARE_MIN]
        if site is None or site.kind == "running" or not explains:
            findings.append(Finding(kind=FindingKind.LOOP_STALLS, severity="info", message=dist, location=loc,
                                    evidence=evidence))
            continue
        best = max(explains, key=lambda t: t.stalled_share - t.rest_share)  # the tail it sets apart most
        call = site.waits_in or site.function
        msg = (f"{dist}: the loop sat in {site.kind} ({call}) at {site.function} during "
               f"{100 * best.stalled_share:.0f}% of the {best.metric.upper()} tail's time (the {best.count} "
               f"{'requests' if best.metric == 'ttft' else 'gaps'} at or above p{best.pct:g}, {best.threshold_ms:.1f} ms), "
               f"against {100 * best.rest_share:.0f}% of the rest's")
        evidence.update({"explains": best.metric, "tail_share": best.stalled_share, "rest_share": best.rest_share})
        findings.append(Finding(
            kind=FindingKind.LOOP_STALLS, severity="warning", message=msg, location=loc, evidence=evidence,
            next_question=(f"Why does the event loop call {call} at {site.where}? Every request on the loop waits "
                           "while it does: await an async equivalent, or move it off the loop (loop.run_in_executor, "
                           "asyncio.to_thread).")))
    return findings, measurements, summary


# The serving probe's question about bursts, and what it becomes once the socket option rules Nagle out.
NAGLE_QUESTION = ("Is Nagle's algorithm on for the server's connections (TCP_NODELAY unset; stalls of about 40 ms, one "
                  "delayed ACK, on reused keep-alive connections), or does the server batch stream output on purpose "
                  "(a stream interval)?")
NO_NAGLE_QUESTION = ("Does the server batch stream output on purpose (a stream interval), or does a thread that writes "
                     "the stream stall?")
BURST_GAP_S = 0.0005  # the serving probe's: gaps this short are chunks of one read (a burst)
HOLD_SHARE_MIN = 0.3  # of the waits before bursts, the loop stalled: the bursts line up with stalls


def burst_holds(result: dict[str, Any], stalls: list[tuple[float, float]]) -> dict[str, float] | None:
    """How much of the waits that end in a burst (the gap before a run of chunks that arrive
    together) the loop spent stalled, beside the same for the other gaps; None without bursts."""
    from infra_agent.trace.loop_stalls import covered

    starts, ttfts, itls = result.get("start_times"), result.get("ttfts"), result.get("itls")
    if not (isinstance(starts, list) and isinstance(ttfts, list) and isinstance(itls, list) and stalls):
        return None
    holds: list[tuple[float, float]] = []
    rest: list[tuple[float, float]] = []
    for s, t, gaps in zip(starts, ttfts, itls, strict=False):
        if not (isinstance(s, (int, float)) and isinstance(t, (int, float)) and isinstance(gaps, list)) or not gaps:
            continue
        at = float(s) + float(t)
        for k, g in enumerate(gaps):
            nxt = gaps[k + 1] if k + 1 < len(gaps) else None
            if g >= BURST_GAP_S:
                (holds if nxt is not None and nxt < BURST_GAP_S else rest).append((at, at + g))
            at += g
    if not holds:
        return None
    h_cov, h_all = covered(holds, stalls)
    r_cov, r_all = covered(rest, stalls)
    return {"holds": len(holds), "hold_stalled_share": h_cov / h_all if h_all else 0.0,
            "rest_stalled_share": r_cov / r_all if r_all else 0.0}


def rank_burst_explanations(findings: list[Finding], loops: list[LoopStalls], result: dict[str, Any] | None,
                            nodelay: dict[str, Any] | None) -> None:
    """Put the explanation the data supports first in every ``bursty_stream`` finding: the loop's
    stalls when the waits before the bursts line up with them; Nagle's algorithm only when the
    server's connections are not known to have it off (``nodelay``: probes/socket_options.py)."""
    bursty = [f for f in findings if f.kind == FindingKind.BURSTY_STREAM]
    if not bursty:
        return
    from infra_agent.trace.intervals import merge

    aligned = None
    for ls in loops if result else []:
        h = burst_holds(result, merge(ls.intervals_unix_s()))  # type: ignore[arg-type]
        if h is not None and h["hold_stalled_share"] >= HOLD_SHARE_MIN and \
                h["hold_stalled_share"] > h["rest_stalled_share"]:
            aligned = (ls, h)
            break
    nagle_off = nodelay is not None and nodelay["nodelay"] == nodelay["connections"]
    for f in bursty:
        first: list[str] = []
        if aligned is not None:
            ls, h = aligned
            site = ls.top_time_site()
            where = f" (most of it at {site.function}, {site.where})" if site else ""
            f.message += (f"; the bursts line up with event-loop stalls: the loop {ls.thread} was away from its "
                          f"selector during {100 * h['hold_stalled_share']:.0f}% of the waits before the "
                          f"{h['holds']} bursts, against {100 * h['rest_stalled_share']:.0f}% of the other gaps{where}")
            f.evidence.update({"loop_stall_thread": ls.thread, **h})
            first.append(f"Unstall the event loop {ls.thread}{where} first: chunks wait while it is away from "
                         "its selector and leave together when it returns.")
        if nodelay is not None:
            f.evidence["tcp_nodelay"] = nodelay
            f.message += (f"; TCP_NODELAY is set on {nodelay['nodelay']} of the {nodelay['connections']} server "
                          "connections read, so Nagle's algorithm is " + ("not the cause" if nagle_off else "on for some"))
        question = f.next_question or NAGLE_QUESTION
        if nagle_off:  # ruled out by the socket option itself: ask about the rest
            question = question.replace(NAGLE_QUESTION, NO_NAGLE_QUESTION)
        f.next_question = " ".join(first) + " Only if bursts remain: " + question if first else question
