"""Timeline analysis as Feedback: local findings the agent can act on.

Each finding names a thread and a span, for GIL findings the holder's ``file:line``,
carries its evidence numbers, and asks a next question that names a knob or a code
path.  ``knob_hints`` lets the caller (a TimelineProbe that knows the workspace's
knobs) map a holder's file, function or span to a knob name, e.g.
``{"moe.py": "ep_release_gil"}``; without it the question names the code path.
"""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier
from infra_agent.trace.analyze import TimelineReport
from infra_agent.trace.thread_blocked import MIN_SAMPLES, thread_blocked
from infra_agent.trace.trends import PositionLatency
from infra_agent.vocabulary import FindingKind

WAIT_SHARE_MIN = 0.5  # a group waited at least half its sampled time ...
HOLDER_SHARE_MIN = 0.5  # ... and one other thread held the GIL for at least half of that
GIL_WAIT_SHARE_MIN = 0.15  # with dump snapshots: or it waited for the GIL itself this share, one holder half
WAIT_US_MIN = 1000.0
EXPECT_SHARE_MIN = 0.2
STEP_OVERHEAD_MIN = 0.2
IDLE_SHARE_MIN = 0.5
# A collection this long stalls a step many times over (a decode step is ~0.3-10 ms here);
# or the collector's total share of the window, whichever fires first.
GC_PAUSE_MIN_US = 20_000.0
GC_SHARE_MIN = 0.02
GC_SITE_SHARE_MIN = 0.3  # the code that began this share of the collector's time is named as the cause


def _knob(hints: dict[str, str], *texts: str) -> str | None:
    for key, knob in hints.items():
        if any(key in t for t in texts if t):
            return knob
    return None


def _split_where(where: str) -> tuple[str, int | None]:
    file, _, line = where.rpartition(":")
    return (file, int(line)) if file and line.isdigit() else (where, None)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def findings(report: TimelineReport, knob_hints: dict[str, str] | None = None,
             position: PositionLatency | None = None) -> list[Finding]:
    """Every finding the report supports, one kind after another (the order the agent reads them in)."""
    hints = knob_hints or {}
    return [
        *thread_blocked(report.thread_states),
        *_gil_contention(report, hints),
        *_absent_expected(report),
        *_no_overlap(report, hints),
        *_unobserved(report),
        *_thread_idle(report),
        *_launch_bound(report),
        *_span_trends(report),
        *_transfer_wait(report, hints),
        *_step_overhead(report),
        *_gc_pause(report, hints),
        *_position_latency(position),
    ]


def _gil_contention(report: TimelineReport, hints: dict[str, str]) -> list[Finding]:
    """A group that waited most of its time while one other thread held the GIL: who held it, and where."""
    out: list[Finding] = []
    for w in report.waits:
        if w.waiting_share < WAIT_SHARE_MIN or w.waiting_us < WAIT_US_MIN or not w.holders:
            continue
        top, decisive = w.holders[0], None
        if w.gil_wait_us is not None and w.gil_wait_holders and w.gil_wait_us >= max(WAIT_US_MIN, GIL_WAIT_SHARE_MIN * w.span_us):
            # Snapshots tell the wait for the GIL from the thread's own I/O, locks or a missing CPU (held by
            # no one): the holder's share of the wait for the GIL alone, which a loaded machine does not dilute.
            holder = next(iter(w.gil_wait_holders))  # the largest share first
            top, decisive = next((h for h in w.holders if h.thread == holder), top), w.gil_wait_holders[holder]
        thread_share = w.holder_threads.get(top.thread, 0.0)
        if max(thread_share, decisive or 0.0) < HOLDER_SHARE_MIN:
            continue
        file, line = _split_where(top.where)
        hs = report.holder_spans.get(f"{w.group}@{w.thread}") or {}
        span = str(hs.get("span")) if hs else None
        overlap = None
        if span:
            p = report.overlap.pair(f"{w.group}@{w.thread}", f"{span}@{top.thread}")
            overlap = p.share_of_a if p else None
        knob = _knob(hints, top.where, top.function, span or "")
        during = f" inside {span}" if span else ""
        idle = w.idle_holders.get(top.thread, 0.0)
        msg = (f"{w.group} (thread {w.thread}) waited {_pct(w.waiting_share)} of its sampled time "
               f"({w.waiting_us / 1e3:.1f} ms); meanwhile the GIL holder was {top.thread} at {top.where} ({top.function})"
               f"{during} in {_pct(top.share)} of it"
               + (f"; it waited for the GIL itself in {_pct(w.gil_wait_us / w.span_us)} of its time, {top.thread} "
                  f"owning it in {_pct(decisive)} of that" if decisive is not None and w.span_us else "")
               + (f"; {top.thread} held it while idle (a native call that sleeps or blocks without releasing "
                  f"it) in {_pct(idle)} of the wait" if idle > 0 else ""))
        out.append(Finding(
            kind=FindingKind.GIL_CONTENTION, severity="warning", message=msg,
            location=Location(file=file, line=line, thread=top.thread, span=span, knob=knob, component="runtime"),
            evidence={"waiting_thread": w.thread, "waiting_group": w.group, "waiting_us": w.waiting_us,
                      "waiting_share": w.waiting_share, "holder_share": top.share, "holder_thread_share": thread_share,
                      "holder_idle_share": idle, "gil_wait_us": w.gil_wait_us, "holder_gil_wait_share": decisive,
                      "intervals": w.intervals, **({"overlap_share": overlap} if overlap is not None else {})},
            next_question=(f"Does the call at {top.where} release the GIL while it runs native code? "
                           + (f"Try knob {knob}." if knob else f"Release it there (Py_BEGIN_ALLOW_THREADS / a knob "
                              f"that releases it) so {w.thread} can run during {span or top.function}.")),
        ))
    # Holding the GIL while idle first: that holder gives it up at no cost to itself, while one
    # that runs Python in it needs it (two threads that wait on each other on a loaded machine
    # give two findings of about the same size; the idle holder's is the one to fix first).
    out.sort(key=lambda f: -f.evidence["holder_idle_share"] / max(f.evidence["holder_thread_share"], 1e-9))
    return out


def _no_overlap(report: TimelineReport, hints: dict[str, str]) -> list[Finding]:
    """An expected overlap whose sides both ran but hardly overlapped, with the GIL holder during them."""
    out: list[Finding] = []
    for e in report.expected:
        if e.a_us > 0 and e.b_us > 0 and e.share_of_a < EXPECT_SHARE_MIN:
            a_on = f" (thread {', '.join(e.a_threads)})" if e.a_threads else ""
            b_on = f" (thread {', '.join(e.b_threads)})" if e.b_threads else ""
            msg = f"{e.a}{a_on} overlapped {_pct(e.share_of_a)} of {e.b}{b_on}"
            loc = Location(span=e.b, knob=_knob(hints, e.a, e.b))
            question = f"What serialises {e.a} with {e.b}: the GIL (record py-spy --gil), a lock, or a queue?"
            if e.holders_during_b:
                h = e.holders_during_b[0]
                where, fn = str(h["where"]), str(h["function"])
                file, line = _split_where(where)
                msg += f"; during them the GIL holder was {h['thread']} at {where} in {_pct(float(h['share']))} of the time"  # type: ignore[arg-type]
                knob = _knob(hints, where, fn, e.b)
                loc = Location(file=file, line=line, thread=str(h["thread"]), span=e.b, knob=knob)
                question = (f"Does {fn} at {where} hold the GIL while it spins in native code? "
                            + (f"Try knob {knob}." if knob else "Release the GIL around that native call."))
            out.append(Finding(kind=FindingKind.NO_OVERLAP, severity="warning", message=msg, location=loc,
                               evidence={k: v for k, v in e.to_dict().items() if k not in ("a_threads", "b_threads")},
                               next_question=question))
    return out


def _unobserved(report: TimelineReport) -> list[Finding]:
    """What the trace could not see: overlap with uninstrumented threads, GIL holders without a sampler."""
    out: list[Finding] = []
    if report.overlap.note:
        out.append(Finding(kind=FindingKind.OVERLAP_UNMEASURABLE, message=report.overlap.note,
                           next_question="Instrument the other threads (transfer, communication) with spans to see "
                                         "whether they overlap the main loop."))
    if report.samples == 0 and any("py-spy" in w for w in report.warnings):
        out.append(sampler_unavailable(next(w for w in report.warnings if "py-spy" in w)))
    return out


def sampler_unavailable(warning: str) -> Finding:
    """py-spy sampled nothing: the sampler's own reason, and what would let it sample."""
    question = ("Send more requests (the scenario's num_requests) or lower lead_s, so that sampling starts while "
                "the load runs." if "lead_s" in warning else
                "Run with ptrace allowed (root or CAP_SYS_PTRACE) to attribute waits to GIL holders.")
    return Finding(kind=FindingKind.SAMPLER_UNAVAILABLE, severity="warning", message=warning, next_question=question)


def _thread_idle(report: TimelineReport) -> list[Finding]:
    """The busiest host thread idle for most of the window."""
    streams = {r.stream for r in report.streams}
    host_threads = [t for t in report.threads if t.thread.strip() not in streams]
    if not host_threads:
        return []
    busiest = host_threads[0]
    if not (busiest.window_us > 0 and busiest.idle_us / busiest.window_us >= IDLE_SHARE_MIN):
        return []
    gap = (report.gaps.get(busiest.thread) or [(0.0, 0.0)])[0]
    return [Finding(
        kind=FindingKind.THREAD_IDLE, message=f"the busiest thread {busiest.thread} was idle "
        f"{_pct(busiest.idle_us / busiest.window_us)} of the window; longest gap {(gap[1] - gap[0]) / 1e3:.1f} ms",
        location=Location(thread=busiest.thread), evidence=busiest.to_dict(),
        next_question="Is the load too light to keep it busy, or does it wait on input (queue, HTTP, transfer)?")]


def _span_trends(report: TimelineReport) -> list[Finding]:
    """A span whose duration rises over the window, beside the model's spans that stayed flat."""
    out: list[Finding] = []
    flat = [t.name for t in report.trends if t.flat and t.name in ("model.forward", "decode")]
    for t in report.trends:
        if not t.rising:
            continue
        best = t.best_fit()
        msg = t.describe() + (f", while {flat[0]} stayed flat" if flat else "")
        site, code = t.site, ""
        loc = Location(span=t.name)
        if site is not None:
            # The code whose share of the span's thread grew with it: where the growing work is.
            file, line = _split_where(site.where)
            loc = Location(span=t.name, file=file, line=line, function=site.function)
            msg += (f"; the growth is in {site.function} ({site.where}): {_pct(site.before or 0.0)} → "
                    f"{_pct(site.share)} of its thread's working samples")
            code = f" Look at {site.function} ({site.where}) first."
        out.append(Finding(
            kind=FindingKind.SPAN_TREND, severity="warning", message=msg, location=loc,
            evidence={"n": t.n, "mean_first_us": t.mean_first_us, "mean_last_us": t.mean_last_us, "ratio": t.ratio,
                      **({"size": t.size, "size_at": t.size_at, "adj_first_us": t.adj_first_us,
                          "adj_last_us": t.adj_last_us, "size_ratio": t.size_ratio} if t.size else {}),
                      **({"share_first": t.share_first, "share_last": t.share_last, "share_ratio": t.share_ratio}
                         if t.share_ratio is not None else {}),
                      **({"slope": best.slope, "slope_unit": best.unit, "r2": best.r2} if best else {}),
                      **({"site": site.to_dict()} if site is not None else {})},
            next_question=f"What in {t.name} scales with {best.regressor if best else 'time'}? Look for work over all "
                          "tokens generated so far (O(n) per step, O(n²) per request)." + code))
    return out


def _step_overhead(report: TimelineReport) -> list[Finding]:
    """Non-model work taking a large share of the engine's steps."""
    ss = report.step_shares
    if ss is None or not (ss.step_us > 0 and ss.non_model_share >= STEP_OVERHEAD_MIN):
        return []
    shares = {k: v / ss.step_us for k, v in ss.by_name.items()}
    # Step time in no child span is a part of its own: the largest when nothing named beats it.
    shares["untraced"] = shares.get("untraced", 0.0) + ss.untraced_us / ss.step_us
    top_name = ss.top_phase
    msg = (f"non-model work took {_pct(ss.non_model_share)} of {ss.step_span} time over {ss.steps} steps "
           f"(largest: {top_name} {_pct(shares[top_name])})")
    loc = Location(span=top_name, component="engine.loop")
    question = f"Can {top_name} move off the step's critical path (overlap it with the forward pass, or batch it)?"
    site = ss.site
    if site is not None:
        file, line = _split_where(site.where)
        loc = Location(span=top_name, component="engine.loop", file=file, line=line, function=site.function)
        msg += f"; the step's {top_name} part is {site.function} ({site.where}), in {_pct(site.share)} of its thread's working samples"
        question = (f"What does {site.function} ({site.where}) do in every {ss.step_span}? Move it off the step "
                    "(a thread of its own, or batched over steps), or make it cheaper.")
    return [Finding(kind=FindingKind.STEP_OVERHEAD, severity="warning", message=msg, location=loc,
                    evidence=ss.to_dict(), next_question=question)]


def _transfer_wait(report: TimelineReport, hints: dict[str, str]) -> list[Finding]:
    """A step thread that spends a share of its steps moving KV out: the next prefill waits on the transfer."""
    from infra_agent.trace.transfer_wait import TRANSFER_WAIT_SHARE_MIN

    out: list[Finding] = []
    for w in report.transfer_waits:
        if w.share < TRANSFER_WAIT_SHARE_MIN:
            continue
        parts = ", ".join(f"{n} {_pct(us / w.step_us)}" for n, us in w.by_name.items())
        msg = (f"{w.thread} spent {_pct(w.share)} of its {w.steps} steps ({w.transfer_us / 1e3:.1f} of "
               f"{w.step_us / 1e3:.1f} ms) moving KV out ({parts}) for {w.requests} request(s): the next step waits "
               "until the transfer is through")
        if w.layered:
            msg += "; the transfer already goes layer by layer, so this is what the link still holds after the last layer"
            question = ("The layers already overlap the compute: is the link too slow for the prefill rate (a faster "
                        "link, fewer bytes per token: a smaller KV cache dtype), or can the step stop waiting for it "
                        "(send from a thread that keeps the slot until the pages are out)?")
        else:
            msg += ", and it starts only after the whole prefill"
            question = ("Can the transfer overlap the prefill's compute: send each layer's KV as soon as that layer is "
                        "computed (a layer-wise transfer; refstack: kv_transfer_granularity=layer), so the step waits "
                        "only for what the link still holds after the last layer?")
        knob = _knob(hints, w.top)
        out.append(Finding(kind=FindingKind.TRANSFER_WAIT, severity="warning", message=msg,
                           location=Location(thread=w.thread, span=w.top, knob=knob, component="kv_transfer"),
                           evidence=w.to_dict(), next_question=question + (f" Try knob {knob}." if knob else "")))
    return out


def _gc_pause(report: TimelineReport, hints: dict[str, str]) -> list[Finding]:
    """Garbage collection that stopped the process long enough, or often enough, to matter."""
    gcp = report.gc
    if gcp is None or not (gcp.longest_us >= GC_PAUSE_MIN_US or gcp.share >= GC_SHARE_MIN):
        return []
    thread = max(gcp.by_thread, key=gcp.by_thread.__getitem__, default=None)
    full = gcp.by_generation.get(2, {})
    knob = _knob(hints, "gc")
    loc = Location(component="runtime.gc", span="gc", thread=thread, knob=knob)
    freeze = ("Does a full collection walk objects that live for the whole run (the model's modules and tensors, the "
              "imports)? Freeze them once startup is done (gc.collect(); gc.freeze(), as vLLM and SGLang do)"
              + (f": try knob {knob}." if knob else ", or raise the collector's thresholds."))
    msg = (f"Python's garbage collector stopped the process for {gcp.total_us / 1e3:.1f} ms in {gcp.count} "
           f"collection(s), {_pct(gcp.share)} of the window; the longest, generation {gcp.longest_generation}, took "
           f"{gcp.longest_us / 1e3:.1f} ms"
           + (f" ({int(full['count'])} full collection(s), {full['total_us'] / 1e3:.1f} ms)" if full else "")
           + (f", on thread {thread}" if thread else ""))
    question = freeze
    site = gcp.sites[0] if gcp.sites and float(gcp.sites[0]["share"]) >= GC_SITE_SHARE_MIN else None
    if site is not None:
        # Allocation that keeps crossing the threshold is what starts the collections: its code is the cause.
        file, line = _split_where(str(site["where"]))
        loc = Location(component="runtime.gc", span="gc", thread=thread, knob=knob, file=file, line=line,
                       function=str(site["function"]))
        msg += (f"; allocations in {site['function']} ({site['where']}) began {int(site['count'])} of them, "
                f"{_pct(float(site['share']))} of the collector's time")
        question = (f"What does {site['function']} ({site['where']}) allocate on every call (lists of tuples, dicts, "
                    "objects kept for a while)? Fewer Python objects there (reuse a buffer, keep numbers in a tensor "
                    "or an array) means fewer collections. " + freeze)
    return [Finding(kind=FindingKind.GC_PAUSE, severity="warning", message=msg, location=loc,
                    evidence=gcp.to_dict(), next_question=question)]


def _position_latency(position: PositionLatency | None) -> list[Finding]:
    """Inter-token latency that rises with the output position (from a serving result, when given)."""
    if position is None or not position.rising or position.fit is None:
        return []
    return [Finding(
        kind=FindingKind.LATENCY_RISES_WITH_POSITION, severity="warning",
        message=f"inter-token latency rises with output position: {position.mean_first_ms:.2f} → "
                f"{position.mean_last_ms:.2f} ms, slope {position.fit.slope * 1e3:.3g} µs per position "
                f"(r²={position.fit.r2:.2f}, {position.requests} requests)",
        location=Location(component="engine"), evidence={k: v for k, v in position.to_dict().items() if k != "per_position_ms"},
        next_question="Which per-step work scans every generated token (sampling penalties, detokenisation, "
                      "stop-string checks)? That is O(n²) per request.")]


def measurements(report: TimelineReport) -> list[Measurement]:
    out = [Measurement.from_samples("thread_busy_share", "ratio", [t.busy_share], thread=t.thread)
           for t in report.threads[:8]]
    out += [Measurement.from_samples("gil_wait_share", "ratio", [w.waiting_share], better="lower", thread=w.thread,
                                     interval=w.group) for w in report.waits[:8]]
    out += [Measurement.from_samples("gpu_busy_share", "ratio", [r.busy_share], better="higher", thread=r.stream,
                                     interval=r.reference) for r in report.streams]
    out += [Measurement.from_samples("overlap_share", "ratio", [e.share_of_a], better="higher", interval=f"{e.a}|{e.b}")
            for e in report.expected]
    if report.thread_states is not None:
        # Blocked off the GIL, its normal wait left out: the share a fix of the call site gives back.
        sampled = [t for t in report.thread_states.threads if t.samples >= MIN_SAMPLES]
        out += [Measurement.from_samples("thread_blocked_share", "ratio", [t.blocked_share], better="lower",
                                         thread=t.thread) for t in sampled[:8]]
    out += [Measurement.from_samples("transfer_wait_share", "ratio", [w.share], better="lower", thread=w.thread,
                                     component="kv_transfer") for w in report.transfer_waits]
    out += [Measurement.from_samples("layer_overlap_share", "ratio", [lo.share], better="higher",
                                     interval=f"layer {lo.layer}") for lo in report.overlap.layers]
    if report.gc is not None:
        # The longest stop of the window: what one unlucky step (and every stream in it) waited.
        out.append(Measurement.from_samples("gc_pause_ms", "ms", [report.gc.longest_us / 1e3], better="lower",
                                            component="runtime.gc"))
        out.append(Measurement.from_samples("gc_share", "ratio", [report.gc.share], better="lower", component="runtime.gc"))
    return out


def timeline_feedback(report: TimelineReport, probe: str = "timeline", knob_hints: dict[str, str] | None = None,
                      serving_result: Any = None, meta: dict[str, Any] | None = None) -> Feedback:
    """The report as Feedback; ``serving_result`` (a bench result dict or request records)
    adds the per-position latency finding."""
    from infra_agent.trace.trends import position_latency

    position = position_latency(serving_result) if serving_result is not None else None
    info: dict[str, Any] = {"window_us": report.window[1] - report.window[0], "samples": report.samples,
                            "warnings": report.warnings, **(meta or {})}
    if position is not None:
        info["position_latency"] = {k: v for k, v in position.to_dict().items() if k != "per_position_ms"}
    return Feedback(probe=probe, tier=Tier.trace, scope=["runtime", "engine", "thread", "span"],
                    measurements=measurements(report), findings=findings(report, knob_hints, position), meta=info)


def _absent_expected(report: TimelineReport) -> list[Finding]:
    """An expected overlap with a side that has no spans at all cannot be measured: say which
    side, and when a trace was recorded at a level that leaves per-layer spans out, that the
    level is why and which setting records them."""
    out: list[Finding] = []
    levels = sorted({str(src["level"]) for src in report.sources if src.get("level") and src["level"] != "layer"})
    for e in report.expected:
        absent = [g for g, us in ((e.a, e.a_us), (e.b, e.b_us)) if us <= 0]
        if not absent:
            continue
        msg = f"expected overlap {e.a}:{e.b} cannot be measured: no {' and no '.join(absent)} spans in the trace"
        question = f"Does the traced window run {' or '.join(absent)}, and is it instrumented with spans?"
        knob = None
        if levels:
            msg += (f" (recorded at trace level {', '.join(levels)}, which leaves out the per-layer spans: "
                    f"kda, attn, moe, ep, model, lm_head)")
            question = ("Record the window at trace level layer (refstack: --trace-level layer / knob trace_level; "
                        "elsewhere INFRA_AGENT_TRACE_LEVEL=layer), then look again.")
            knob = "trace_level"
        out.append(Finding(kind=FindingKind.OVERLAP_UNMEASURABLE, severity="warning", message=msg,
                           location=Location(span=absent[0], knob=knob, component="observability.tracing"),
                           evidence={"a": e.a, "b": e.b, "a_us": e.a_us, "b_us": e.b_us, "levels": levels},
                           next_question=question))
    return out


def _launch_bound(report: TimelineReport) -> list[Finding]:
    """A GPU stream idle for most of the engine's steps: the GPU waited on the host."""
    from infra_agent.trace.gpu import LAUNCH_BOUND_BUSY_MAX

    out: list[Finding] = []
    for r in report.streams:
        if r.reference != "engine.step" or r.busy_share >= LAUNCH_BOUND_BUSY_MAX:
            continue
        out.append(Finding(
            kind=FindingKind.LAUNCH_BOUND, severity="warning",
            message=(f"GPU {r.stream} was busy {_pct(r.busy_share)} of the engine's steps ({r.kernels} device events, "
                     f"median {r.median_kernel_us:.1f} us each): the steps are launch-bound, the GPU waits on the host "
                     f"between kernels"),
            location=Location(thread=r.stream, span="engine.step", component="engine.loop"), evidence=r.to_dict(),
            next_question="Can the step launch fewer kernels: capture it in a CUDA graph, or fuse its small kernels "
                          "(norms, quantisation, elementwise) into the GEMMs beside them?"))
    return out
