"""One call from a loaded timeline to every interval analysis, as one report.

``analyze(timeline)`` runs: per-thread busy/idle/waiting time, idle gaps, the overlap
matrix, GIL attribution of waits (when py-spy samples are loaded), every sampled
thread's states (from py-spy dumps, with or without spans), critical paths of
requests (when spans carry request ids), span trends and per-step shares.  The report
is plain data (``to_dict()`` is JSON); :mod:`infra_agent.trace.feedback` turns it into
findings.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from infra_agent.trace.code_sites import growth_site, phase_site
from infra_agent.trace.critical import CriticalPath, critical_paths
from infra_agent.trace.gc_pauses import GC_SPAN, GCPauses, gc_pauses
from infra_agent.trace.gil import (
    Holder,
    WaitReport,
    holder_shares,
    holder_timeline,
    waiting_analysis,
)
from infra_agent.trace.intervals import (
    Interval,
    ThreadTime,
    gaps,
    intersect,
    merge,
    thread_times,
    total,
)
from infra_agent.trace.model import Span, Timeline
from infra_agent.trace.overlap import OverlapMatrix, overlap_between, overlap_matrix
from infra_agent.trace.thread_states import ThreadStatesReport, thread_states
from infra_agent.trace.transfer_wait import transfer_waits


@dataclass
class ExpectedOverlap:
    """Two span groups (names or categories) that ought to run at the same time."""

    a: str
    b: str
    a_us: float
    b_us: float
    both_us: float
    a_threads: list[str] = field(default_factory=list)
    b_threads: list[str] = field(default_factory=list)
    # who held the GIL during b (py-spy samples), largest share first
    holders_during_b: list[dict[str, object]] = field(default_factory=list)

    @property
    def share_of_a(self) -> float:
        return self.both_us / self.a_us if self.a_us else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"a": self.a, "b": self.b, "a_us": self.a_us, "b_us": self.b_us, "both_us": self.both_us,
                "share_of_a": self.share_of_a, "a_threads": self.a_threads, "b_threads": self.b_threads,
                "holders_during_b": self.holders_during_b}


@dataclass
class TimelineReport:
    window: Interval
    sources: list[dict[str, Any]]
    warnings: list[str]
    threads: list[ThreadTime]
    overlap: OverlapMatrix
    waits: list[WaitReport] = field(default_factory=list)
    # waiting group -> the holder thread's most specific span during the waits
    holder_spans: dict[str, dict[str, object]] = field(default_factory=dict)
    expected: list[ExpectedOverlap] = field(default_factory=list)
    gaps: dict[str, list[Interval]] = field(default_factory=dict)  # thread -> longest idle gaps
    paths: list[CriticalPath] = field(default_factory=list)
    trends: list[Any] = field(default_factory=list)  # trends.SpanTrend
    step_shares: Any = None  # trends.StepShares
    samples: int = 0
    gc: GCPauses | None = None  # the cyclic collector's pauses, when the trace has gc spans
    streams: list[Any] = field(default_factory=list)  # gpu.StreamReport, from a Kineto trace's device events
    # every dump-sampled thread's states (running, waiting for the GIL, blocked, idle)
    thread_states: ThreadStatesReport | None = None
    transfer_waits: list[Any] = field(default_factory=list)  # transfer_wait.TransferWait, per step thread

    def to_dict(self) -> dict[str, object]:
        return {
            "window_us": list(self.window), "duration_us": self.window[1] - self.window[0],
            "sources": self.sources, "warnings": self.warnings, "samples": self.samples,
            "threads": [t.to_dict() for t in self.threads],
            "overlap": self.overlap.to_dict(),
            "waits": [w.to_dict() for w in self.waits],
            "holder_spans": self.holder_spans,
            "expected_overlap": [e.to_dict() for e in self.expected],
            "gaps": {t: [{"start_us": s, "dur_us": e - s} for s, e in g] for t, g in self.gaps.items()},
            "critical_paths": [p.to_dict() for p in self.paths],
            "trends": [t.to_dict() for t in self.trends],
            "step_shares": self.step_shares.to_dict() if self.step_shares is not None else None,
            "gc": self.gc.to_dict() if self.gc is not None else None,
            "streams": [r.to_dict() for r in self.streams],
            "thread_states": self.thread_states.to_dict() if self.thread_states is not None else None,
            "transfer_waits": [w.to_dict() for w in self.transfer_waits],
        }


def _innermost(spans: list[Span], pieces: list[Interval]) -> dict[str, float]:
    """µs of ``pieces`` per span name, each instant credited to the innermost span of one
    thread's (nested) spans covering it: the one that started last."""
    ordered = sorted(spans, key=lambda s: (s.start_us, -s.end_us))
    bounds = sorted({x for s in ordered for x in (s.start_us, s.end_us)} | {x for iv in pieces for x in iv})
    out: dict[str, float] = defaultdict(float)
    active: list[Span] = []
    i = j = 0
    for a, b in pairwise(bounds):
        while i < len(ordered) and ordered[i].start_us <= a:
            active.append(ordered[i])
            i += 1
        active = [s for s in active if s.end_us > a]
        while j < len(pieces) and pieces[j][1] <= a:
            j += 1
        inside = sum(max(0.0, min(b, e) - max(a, s)) for s, e in pieces[j:j + 2])
        if inside > 0 and active:
            out[active[-1].name] += inside
    return out


def _with_its_category(mine: list[Span], amount: dict[str, float]) -> list[str]:
    """The top span name by ``amount`` and the others of its category (``ep.dispatch|ep.combine``),
    in the order they first start."""
    cats = {s.name: s.cat for s in mine}
    first: dict[str, float] = {}
    for s in sorted(mine, key=lambda s: s.start_us):
        first.setdefault(s.name, s.start_us)
    top = max(amount, key=lambda n: amount[n])
    return sorted((n for n in amount if n == top or (cats.get(top) and cats.get(n) == cats.get(top))),
                  key=lambda n: first[n])


def _span_by_stack(spans: list[Span], thread: str, holders: list[Holder]) -> dict[str, object] | None:
    """The holder thread's spans named after the functions its sampled stacks held the GIL in
    (``_combine`` -> ``ep.combine``), when those make most of the holding.

    Why before the clock: a dump's time is known only to within the dump (0.1-0.5 s, longer
    on a loaded machine), while per-layer spans last milliseconds and alternate, so a sample
    placed by its time falls in whichever span takes the most wall time (on a loaded box the
    compute-bound mixer, not the EP section the stack was in).  The stack is exact."""
    mine = [s for s in spans if s.thread == thread]
    if not mine:
        return None
    dur: dict[str, float] = defaultdict(float)
    for s in mine:
        dur[s.name] += s.end_us - s.start_us
    count = Counter(s.name for s in mine)
    share: dict[str, float] = defaultdict(float)
    for h in holders:
        if h.thread != thread:
            continue
        named = [n for n in dur if n.rsplit(".", 1)[-1] == h.function.strip("_")]
        if named:  # the innermost of the spans named so (ep.combine inside moe.combine): the shortest
            share[min(named, key=lambda n: dur[n] / count[n])] += h.share
    if not share or sum(share.values()) < 0.5:
        return None
    names = _with_its_category(mine, share)
    return {"thread": thread, "span": "|".join(names), "share_of_wait": sum(share[n] for n in names), "by": "stack"}


def _holder_span(spans: list[Span], thread: str, waiting: list[Interval],
                 held: list[Interval] | None = None) -> dict[str, object] | None:
    """The holder thread's spans during ``waiting``.

    With its GIL-holding stretches (``held``, from the samples): the innermost spans it was
    in while it held the GIL during the waits, those of the top one's category together
    (``ep.dispatch|ep.combine``, not the ``engine.step`` around them).  Without: the names
    whose spans fell (almost) entirely inside the waits, else the name covering most."""
    mine = [s for s in spans if s.thread == thread]
    waited = total(waiting)
    if not mine or waited <= 0:
        return None
    if held:
        pieces = intersect(merge(held), waiting)
        inner = _innermost(mine, pieces)
        if inner:
            names = _with_its_category(mine, inner)
            return {"thread": thread, "span": "|".join(names), "share_of_wait": sum(inner[n] for n in names) / waited,
                    "by": "clock"}
    by_name: dict[str, list[Interval]] = defaultdict(list)
    for s in mine:
        by_name[s.name].append((s.start_us, s.end_us))
    merged = {name: merge(ivs) for name, ivs in by_name.items()}
    cover = {name: total(intersect(m, waiting)) for name, m in merged.items()}
    inside = sorted((n for n, m in merged.items() if cover[n] > 0 and cover[n] >= 0.8 * total(m)), key=lambda n: -cover[n])
    names = inside or [max(cover, key=lambda n: cover[n])]
    if cover[names[0]] <= 0:
        return None
    both = total(intersect(merge(iv for n in names for iv in merged[n]), waiting))
    return {"thread": thread, "span": "|".join(names), "share_of_wait": both / waited, "by": "clock"}


def _while_sampled(timeline: Timeline, spans: list[Span]) -> list[Span]:
    """The spans a trend compares: with py-spy samples, those inside the sampled window only.
    The sampler takes CPU time from the target (a dump reads every thread's stack), so on a
    machine with few cores the spans before it started ran faster, and every span would seem
    to rise across the window."""
    if timeline.sampled_window is None:
        return spans
    lo, hi = timeline.sampled_window
    return [s for s in spans if s.start_us >= lo and s.end_us <= hi]


def _phase_of(spans: list[Span], name: str, phases: list[str]) -> str | None:
    """The step phase (a span of ``phases``) that spans named ``name`` run in: the phase itself,
    else the one holding most of them on their thread; None outside every phase."""
    if name in phases:
        return name
    where: dict[tuple[str, str], list[Interval]] = defaultdict(list)
    for s in spans:
        if s.name in phases:
            where[(s.name, s.thread)].append((s.start_us, s.end_us))
    merged = {k: merge(v) for k, v in where.items()}
    starts = {k: [a for a, _ in v] for k, v in merged.items()}
    votes: dict[str, int] = defaultdict(int)
    for s in spans:
        if s.name != name:
            continue
        for (phase, thread), ivs in merged.items():
            i = bisect_right(starts[(phase, thread)], s.start_us) - 1 if thread == s.thread else -1
            if i >= 0 and s.end_us <= ivs[i][1]:
                votes[phase] += 1
                break
    return max(votes, key=votes.__getitem__) if votes else None


def _code_sites(timeline: Timeline, spans: list[Span], trends: list[Any], shares: Any, step_span: str,
                model_spans: tuple[str, ...]) -> None:
    """Name the code behind a rising span (whose share of its thread rose with it) and behind
    the largest non-model part of the steps (the step function's callee for it), from the
    py-spy dumps (nothing without them)."""
    if not any(s.snapshot for s in timeline.samples):
        return
    phases = list(shares.by_name) if shares is not None else []
    for t in trends:
        if t.rising:
            # A span inside a phase of the step (``sample``; ``attention`` in ``decode``) grows in
            # that phase's code; the step itself, anywhere in it.
            phase = _phase_of(spans, t.name, [*phases, *model_spans]) if t.name != step_span else None
            t.site = growth_site(timeline, {s.thread for s in spans if s.name == t.name}, phase, model_spans, phases)
    if shares is not None and shares.step_us > 0:
        threads = {s.thread for s in spans if s.name == step_span}
        shares.site = phase_site(timeline, threads, shares.top_phase, model_spans, phases)


def analyze(timeline: Timeline, by: str = "cat", expect_overlap: list[tuple[str, str]] | None = None,
            step_span: str = "engine.step", model_spans: tuple[str, ...] = ("decode", "prefill", "model.forward"),
            context_args: tuple[str, ...] | None = None, gap_min_us: float = 1000.0) -> TimelineReport:
    """Every interval analysis of ``timeline`` (see the module docstring)."""
    from infra_agent.trace import trends as trends_mod
    from infra_agent.trace.gpu import stream_reports

    spans = timeline.span_sources()
    gpu = timeline.gpu_spans()  # GPU streams: beside our threads in the matrix, the table, expected overlaps
    timed = spans + gpu
    window = timeline.window()
    if not timed and not timeline.instants and timeline.sampled_window is not None:
        window = timeline.sampled_window  # py-spy samples alone (a server without spans): their window
    waits, waiting_by_thread = waiting_analysis(timeline, by=by)
    segments = holder_timeline(timeline.samples, timeline.sampled_window) if timeline.sampled_window else []
    holder_spans: dict[str, dict[str, object]] = {}
    for w in waits:
        if not w.holder_threads or w.waiting_us <= 0:
            continue
        top_thread = next(iter(w.holder_threads))
        waiting = intersect(merge(waiting_by_thread.get(w.thread, [])),
                            merge((s.start_us, s.end_us) for s in spans if s.thread == w.thread
                                  and (s.name if by == "name" else (s.cat or s.name)) == w.group))
        held = [(g.start_us, g.end_us) for g in segments if g.thread == top_thread]
        found = _span_by_stack(spans, top_thread, w.holders) or _holder_span(spans, top_thread, waiting, held)
        if found:
            holder_spans[f"{w.group}@{w.thread}"] = found
    expected = []
    for a, b in expect_overlap or []:
        a_set, b_set = set(a.split("|")), set(b.split("|"))
        key = "name" if any(s.name in a_set | b_set for s in spans) else "cat"
        a_us, b_us, both, _ = overlap_between(timed, a_set, b_set, by=key)

        def pick(names: set[str], key: str = key) -> list[Span]:
            return [s for s in timed if (s.name if key == "name" else (s.cat or s.name)) in names]

        b_spans = pick(b_set)
        holders, _ = holder_shares(timeline, [(s.start_us, s.end_us) for s in b_spans])
        expected.append(ExpectedOverlap(a, b, a_us, b_us, both, sorted({s.thread for s in pick(a_set)}),
                                        sorted({s.thread for s in b_spans}), [h.to_dict() for h in holders[:3]]))
    thread_gaps: dict[str, list[Interval]] = {}
    by_thread: dict[str, list[Interval]] = defaultdict(list)
    for s in timed:
        by_thread[s.thread].append((s.start_us, s.end_us))
    for thread, ivs in by_thread.items():
        found_gaps = gaps(merge(ivs), window, gap_min_us)
        if found_gaps:
            thread_gaps[thread] = sorted(found_gaps, key=lambda g: g[0] - g[1])[:5]
    trends = trends_mod.span_trends(_while_sampled(timeline, spans), context_args=context_args, step_span=step_span)
    shares = trends_mod.step_shares(spans, step_span=step_span, model_spans=model_spans)
    _code_sites(timeline, spans, trends, shares, step_span, model_spans)
    return TimelineReport(
        window=window, sources=timeline.sources, warnings=list(timeline.warnings),
        threads=thread_times(timed, window, waiting_by_thread),
        # Collector pauses stop every thread rather than run beside them: not a group of work
        # for the overlap matrix (they have their own report, ``gc``).
        overlap=overlap_matrix([s for s in spans if s.cat != GC_SPAN] + gpu, by=by),
        waits=waits, holder_spans=holder_spans, expected=expected,
        gaps=thread_gaps, paths=critical_paths(timeline),
        trends=trends, step_shares=shares,
        samples=len(timeline.samples), gc=gc_pauses(spans, window),
        streams=stream_reports(gpu, spans, window, step_span=step_span),
        thread_states=thread_states(timeline),
        transfer_waits=transfer_waits(spans, step_span=step_span),
    )
