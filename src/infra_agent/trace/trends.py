"""Trends and shares: how span durations move across a window, and where a step's time goes.

- **Span trends.**  Each span name's duration is regressed on time and on each numeric
  context arg its spans carry (batch, tokens, context length, tokens generated so far:
  whichever the instrumentation records).  A span that grows across the window while
  ``model.forward`` stays flat points at per-step work that scales with something the
  model does not (an O(n) scan of generated tokens in sampling, for instance).
- **Step shares.**  Inside each ``engine.step``: model time (``decode``/``prefill``/
  ``model.forward``) versus the rest (schedule, sample, detokenize, HTTP, untraced).
- **Per-position latency.**  Inter-token latency against output position, from a
  serving result's per-request samples: a rising slope means each token costs more
  than the last, the signature of O(n²) work over a generation.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from infra_agent.trace.intervals import Interval, intersect, merge, subtract, total
from infra_agent.trace.model import NS_SLACK_US, Span

RISE_RATIO = 1.5  # last-decile mean / first-decile mean that counts as rising
FLAT_RATIO = 1.2
P_MAX = 0.01


@dataclass
class Fit:
    regressor: str
    slope: float
    unit: str
    r2: float
    p: float
    n: int

    def to_dict(self) -> dict[str, object]:
        return {"regressor": self.regressor, "slope": self.slope, "unit": self.unit, "r2": self.r2, "p": self.p,
                "n": self.n}


@dataclass
class SpanTrend:
    name: str
    n: int
    mean_first_us: float  # first tenth of the window's spans
    mean_last_us: float  # last tenth
    fits: list[Fit] = field(default_factory=list)
    # The same at one size of work (``size``: the spans' ``tokens``, else ``batch``), so a
    # batch that fills up, or prefill steps giving way to decode steps, is no trend: each
    # duration minus the part its size explains (a least-squares line on the size).
    size: str | None = None
    size_at: float = 0.0  # the size the adjusted durations are at (the window's mean)
    adj_first_us: float = 0.0
    adj_last_us: float = 0.0
    adj_time_fit: Fit | None = None
    # Its share of the step it runs in (``engine.step``), when nearly every one runs in a
    # step: a slowdown of the whole machine (another process's load, a profiler attached)
    # lengthens every span, and only work that grows against the rest of the step
    # changes its share.
    share_first: float = 0.0
    share_last: float = 0.0
    share_time_fit: Fit | None = None
    # The code the span's time went to late in the window (py-spy dumps; set by analyze).
    site: Any = None  # code_sites.CodeSite

    @property
    def ratio(self) -> float:
        return self.mean_last_us / self.mean_first_us if self.mean_first_us > 0 else 1.0

    @property
    def size_ratio(self) -> float:
        """Last tenth over first tenth at one size of work (the raw ratio without a size)."""
        if self.size is None:
            return self.ratio
        return self.adj_last_us / self.adj_first_us if self.adj_first_us > 0 else 1.0

    @property
    def share_ratio(self) -> float | None:
        """How much it grew against the rest of its step, last tenth over first tenth: the ratio
        of its time to the rest of the step's (its share's odds), which a whole-machine slowdown
        leaves alone and which, unlike the share itself, does not saturate as the span comes to
        fill its step.  None outside steps."""
        if self.share_time_fit is None:
            return None
        odds = [s / (1 - s) if s < 1 else float("inf") for s in (self.share_first, self.share_last)]
        return odds[1] / odds[0] if odds[0] > 0 else 1.0

    @property
    def rising(self) -> bool:
        """Its duration (at one size of work) rises over the window, and by half or more: measured
        against the rest of its step when it runs in steps, else on the duration itself."""
        time_fit = self.adj_time_fit if self.size is not None else \
            next((f for f in self.fits if f.regressor == "time"), None)
        if time_fit is None or time_fit.slope <= 0 or time_fit.p >= P_MAX:
            return False
        share, fit = self.share_ratio, self.share_time_fit
        if share is None or fit is None:
            return self.size_ratio >= RISE_RATIO
        return share >= RISE_RATIO and fit.slope > 0 and fit.p < P_MAX

    @property
    def flat(self) -> bool:
        return 1 / FLAT_RATIO <= self.size_ratio <= FLAT_RATIO

    def best_fit(self) -> Fit | None:
        ctx = [f for f in self.fits if f.regressor != "time" and f.p < P_MAX]
        return max(ctx, key=lambda f: f.r2) if ctx else None

    def describe(self) -> str:
        text = f"span {self.name}: mean {self.mean_first_us / 1e3:.3g} → {self.mean_last_us / 1e3:.3g} ms across the window"
        if self.size is not None:
            text += (f" ({self.adj_first_us / 1e3:.3g} → {self.adj_last_us / 1e3:.3g} ms at {self.size} "
                     f"{self.size_at:.3g})")
        if self.share_time_fit is not None:
            text += f", {100 * self.share_first:.0f}% → {100 * self.share_last:.0f}% of its step"
        best = self.best_fit()
        if best is not None:
            text += f", slope {best.slope:.3g} {best.unit} (r²={best.r2:.2f})"
        return text

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "n": self.n, "mean_first_us": self.mean_first_us, "mean_last_us": self.mean_last_us,
                "ratio": self.ratio, "size": self.size, "size_at": self.size_at, "adj_first_us": self.adj_first_us,
                "adj_last_us": self.adj_last_us, "size_ratio": self.size_ratio, "share_first": self.share_first,
                "share_last": self.share_last, "share_ratio": self.share_ratio, "rising": self.rising,
                "flat": self.flat, "fits": [f.to_dict() for f in self.fits],
                "site": self.site.to_dict() if self.site is not None else None, "describe": self.describe()}


def _fit(x: list[float], y: list[float], regressor: str, unit: str) -> Fit | None:
    import numpy as np
    from scipy import stats

    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xa.size < 3 or np.ptp(xa) == 0:
        return None
    res = stats.linregress(xa, ya)
    p = float(res.pvalue) if np.isfinite(res.pvalue) else 1.0
    return Fit(regressor, float(res.slope), unit, float(res.rvalue ** 2), p, int(xa.size))


def span_trends(spans: list[Span], context_args: tuple[str, ...] | None = None, min_n: int = 20,
                step_span: str = "engine.step") -> list[SpanTrend]:
    """A trend per span name with at least ``min_n`` spans, rising ones first."""
    by_name: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.end_us > s.start_us:
            by_name[s.name].append(s)
    steps = _Steps(by_name.get(step_span, []))
    out: list[SpanTrend] = []
    for name, ss in by_name.items():
        if len(ss) < min_n:
            continue
        ss.sort(key=lambda s: s.start_us)
        durs = [s.dur_us for s in ss]
        tenth = max(1, len(ss) // 10)
        trend = SpanTrend(name, len(ss), sum(durs[:tenth]) / tenth, sum(durs[-tenth:]) / tenth)
        t0 = ss[0].start_us
        secs = [(s.start_us - t0) / 1e6 for s in ss]
        fit = _fit(secs, durs, "time", "µs per s of trace")
        if fit:
            trend.fits.append(fit)
        _at_one_size(trend, ss, secs, durs, tenth)
        if name != step_span:
            _share_of_step(trend, ss, secs, steps)
        keys = context_args or tuple(sorted({k for s in ss for k, v in s.args.items()
                                             if isinstance(v, (int, float)) and not isinstance(v, bool)}))
        for key in keys:
            rows = [(float(s.args[key]), s.dur_us, s.args.get("batch")) for s in ss
                    if isinstance(s.args.get(key), (int, float)) and not isinstance(s.args.get(key), bool)]
            if len(rows) < 0.9 * len(ss):
                continue  # an arg most spans lack says nothing about the window
            fit = _fit([r[0] for r in rows], [r[1] for r in rows], key, f"µs per {key}")
            if fit:
                trend.fits.append(fit)
            # per row: divide by the batch, so a growing batch does not pass for per-row growth
            if key != "batch" and all(isinstance(r[2], (int, float)) and r[2] > 0 for r in rows):
                fit = _fit([r[0] for r in rows], [r[1] / float(r[2]) for r in rows], f"{key} per row",  # type: ignore[arg-type]
                           f"µs per {key} per row")
                if fit:
                    trend.fits.append(fit)
        out.append(trend)
    return sorted(out, key=lambda t: (not t.rising, -t.ratio))


def _size_key(spans: list[Span]) -> str | None:
    """The arg that measures a span's work (``tokens``, else ``batch``), when nearly every span carries it."""
    for key in ("tokens", "batch"):
        vals = [s.args.get(key) for s in spans]
        if sum(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in vals) >= 0.9 * len(spans):
            return key
    return None


def _at_one_size(trend: SpanTrend, ss: list[Span], secs: list[float], durs: list[float], tenth: int) -> None:
    """Durations at the window's mean size of work (``SpanTrend.size``), their tenths and time fit."""
    import numpy as np

    key = _size_key(ss)
    if key is None:
        return
    rows = [(t, d, float(s.args[key])) for s, t, d in zip(ss, secs, durs, strict=True)
            if isinstance(s.args.get(key), (int, float)) and not isinstance(s.args.get(key), bool)]
    size = np.asarray([r[2] for r in rows])
    dur = np.asarray([r[1] for r in rows])
    at = float(size.mean())
    if np.ptp(size) > 0:
        slope = float(np.polyfit(size, dur, 1)[0])
        dur = dur - slope * (size - at)
    adj = [float(d) for d in dur]
    part = max(1, len(adj) // 10) if len(adj) < len(durs) else tenth
    trend.size, trend.size_at = key, at
    trend.adj_first_us, trend.adj_last_us = sum(adj[:part]) / part, sum(adj[-part:]) / part
    trend.adj_time_fit = _fit([r[0] for r in rows], adj, "time", f"µs per s of trace at {key} {at:.3g}")


class _Steps:
    """The step spans of each thread, to find the one a span runs in."""

    def __init__(self, steps: list[Span]) -> None:
        by: dict[str, list[Span]] = defaultdict(list)
        for s in steps:
            by[s.thread].append(s)
        self.steps = {t: sorted(v, key=lambda s: s.start_us) for t, v in by.items()}
        self.starts = {t: [s.start_us for s in v] for t, v in self.steps.items()}

    def around(self, span: Span) -> Span | None:
        i = bisect.bisect_right(self.starts.get(span.thread, []), span.start_us) - 1
        if i < 0:
            return None
        step = self.steps[span.thread][i]
        return step if step.end_us >= span.end_us - NS_SLACK_US and step.dur_us > 0 else None


def _share_of_step(trend: SpanTrend, ss: list[Span], secs: list[float], steps: _Steps) -> None:
    """The span's share of its step over the window (``SpanTrend.share_*``), when nearly every one runs in a step."""
    rows = [(t, s.dur_us / step.dur_us) for s, t in zip(ss, secs, strict=True) if (step := steps.around(s)) is not None]
    if len(rows) < 0.9 * len(ss) or len(rows) < 3:
        return
    part = max(1, len(rows) // 10)
    trend.share_first = sum(r[1] for r in rows[:part]) / part
    trend.share_last = sum(r[1] for r in rows[-part:]) / part
    trend.share_time_fit = _fit([r[0] for r in rows], [r[1] for r in rows], "time", "share of the step per s of trace")


@dataclass
class StepShares:
    step_span: str
    steps: int
    step_us: float
    model_us: float
    by_name: dict[str, float]  # non-model child span name -> µs inside steps
    untraced_us: float  # step time covered by no child span
    # The code the non-model time went to (py-spy dumps inside it; set by analyze).
    site: Any = None  # code_sites.CodeSite

    @property
    def top_phase(self) -> str:
        """The largest non-model part: a child span's name, or ``untraced`` (step time in no child span)."""
        parts = {**self.by_name, "untraced": self.untraced_us + self.by_name.get("untraced", 0.0)}
        return max(parts, key=parts.__getitem__)

    @property
    def non_model_share(self) -> float:
        return (self.step_us - self.model_us) / self.step_us if self.step_us else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"step_span": self.step_span, "steps": self.steps, "step_us": self.step_us, "model_us": self.model_us,
                "non_model_share": self.non_model_share,
                "shares": {k: v / self.step_us for k, v in self.by_name.items()} if self.step_us else {},
                "untraced_share": self.untraced_us / self.step_us if self.step_us else 0.0,
                "site": self.site.to_dict() if self.site is not None else None}


def step_shares(spans: list[Span], step_span: str = "engine.step",
                model_spans: tuple[str, ...] = ("decode", "prefill", "model.forward")) -> StepShares | None:
    """Where each ``step_span``'s time went: model spans vs everything else inside it."""
    steps = [s for s in spans if s.name == step_span]
    if not steps:
        return None
    by_thread: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.name != step_span:
            by_thread[s.thread].append(s)
    starts: dict[str, list[float]] = {}
    for thread, ss in by_thread.items():
        ss.sort(key=lambda s: s.start_us)
        starts[thread] = [s.start_us for s in ss]
    step_iv: list[Interval] = []
    model_iv: list[Interval] = []
    child_iv: list[Interval] = []
    named: dict[str, list[Interval]] = defaultdict(list)
    for st in steps:
        ss = by_thread.get(st.thread, [])
        lo = bisect.bisect_left(starts.get(st.thread, []), st.start_us)
        hi = bisect.bisect_right(starts.get(st.thread, []), st.end_us)
        step_iv.append((st.start_us, st.end_us))
        for c in ss[lo:hi]:
            if c.end_us > st.end_us:
                continue
            child_iv.append((c.start_us, c.end_us))
            (model_iv if c.name in model_spans else named[c.name]).append((c.start_us, c.end_us))
    steps_m, model_m = merge(step_iv), merge(model_iv)
    non_model = subtract(steps_m, model_m)
    by_name = {name: total(intersect(merge(ivs), non_model)) for name, ivs in named.items()}
    by_name = {k: v for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0}
    return StepShares(step_span, len(steps), total(steps_m), total(intersect(model_m, steps_m)), by_name,
                      total(subtract(steps_m, merge(child_iv))))


@dataclass
class PositionLatency:
    requests: int
    positions: int
    fit: Fit | None
    mean_first_ms: float
    mean_last_ms: float
    per_position_ms: list[float]  # median gap at each output position

    @property
    def rising(self) -> bool:
        return (self.fit is not None and self.fit.slope > 0 and self.fit.p < P_MAX
                and self.mean_last_ms >= FLAT_RATIO * self.mean_first_ms)

    def to_dict(self) -> dict[str, object]:
        return {"requests": self.requests, "positions": self.positions, "fit": self.fit.to_dict() if self.fit else None,
                "mean_first_ms": self.mean_first_ms, "mean_last_ms": self.mean_last_ms, "rising": self.rising,
                "per_position_ms": self.per_position_ms}


def request_gaps(result: Any) -> list[list[float]]:
    """Per-request inter-token gaps in seconds from a serving result (``itls``: a list per
    request, as infra_agent.serving writes it) or a list of request records (``itl``)."""
    if isinstance(result, dict) and isinstance(result.get("itls"), list):
        return [list(map(float, g)) for g in result["itls"] if isinstance(g, list)]
    if isinstance(result, list):
        return [list(map(float, r["itl"])) for r in result if isinstance(r, dict) and isinstance(r.get("itl"), list)
                and r.get("success", True)]
    return []


def position_latency(result: Any, min_requests: int = 1) -> PositionLatency | None:
    """Inter-token latency against output position (1 = the gap after the first token)."""
    import numpy as np

    per_req = [g for g in request_gaps(result) if g]
    if len(per_req) < min_requests:
        return None
    xs = [float(i + 1) for g in per_req for i in range(len(g))]
    ys = [v * 1e3 for g in per_req for v in g]
    longest = max(len(g) for g in per_req)
    per_pos = [float(np.median([g[i] * 1e3 for g in per_req if len(g) > i])) for i in range(longest)]
    tenth = max(1, len(per_pos) // 10)
    return PositionLatency(len(per_req), longest, _fit(xs, ys, "position", "ms per output position"),
                           float(np.mean(per_pos[:tenth])), float(np.mean(per_pos[-tenth:])), per_pos)
