"""The absolute metric-over-experiments plot as inline SVG (no plotting library): the report's
secondary view, beside the decisions plot (:mod:`infra_agent.report.ratio_plot`)."""

from __future__ import annotations

import math
from html import escape

from infra_agent.report.fmt import fmt_num
from infra_agent.report.series import Series

WIDTH, HEIGHT = 880, 340
_LEFT, _RIGHT, _TOP, _BOTTOM = 84, 28, 44, 58
GREEN, GREY, RED, AMBER, INK, GRID = "#1a7f37", "#8c959f", "#cf222e", "#bf8700", "#24292f", "#d8dee4"


def nice_step(span: float, target_ticks: int = 5) -> float:
    """A 1, 2 or 5 × 10^k step that cuts ``span`` into about ``target_ticks`` parts."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / target_ticks
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _y_range(values: list[float]) -> tuple[float, float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    pad = (hi - lo) * 0.08
    lo, hi = lo - pad, hi + pad
    if min(values) >= 0 and lo < 0:
        lo = 0.0
    step = nice_step(hi - lo)
    return math.floor(lo / step) * step, math.ceil(hi / step) * step, step


def x_ticks(lo: int, hi: int) -> list[int]:
    step = max(1, int(nice_step(hi - lo, 10)))
    return list(range(lo - lo % step if lo % step else lo, hi + 1, step))


def render_svg(series: Series) -> str:
    """The plot, or "" when the series has no points (the caller shows ``series.note``)."""
    pts = sorted(series.points, key=lambda p: p.seq)
    if not pts:
        return ""
    values = [p.value for p in pts] + ([series.target] if series.target is not None else [])
    y0, y1, ystep = _y_range(values)
    x0, x1 = pts[0].seq, pts[-1].seq
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    pw, ph = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def sx(x: float) -> float:
        return _LEFT + 12 + (x - x0) / (x1 - x0) * (pw - 24)

    def sy(y: float) -> float:
        return _TOP + ph - (y - y0) / (y1 - y0) * ph

    unit = f" [{series.unit}]" if series.unit else ""
    label = escape(f"{series.metric}{unit}")
    out = [(f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(series.metric)} over experiments" '
            f'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif" font-size="12">'),
           f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>']
    # Grid and y ticks.
    n_ticks = round((y1 - y0) / ystep)
    for i in range(n_ticks + 1):
        y = y0 + i * ystep
        py = sy(y)
        out.append(f'<line x1="{_LEFT}" y1="{py:.1f}" x2="{WIDTH - _RIGHT}" y2="{py:.1f}" stroke="{GRID}" stroke-width="1"/>')
        out.append(f'<text x="{_LEFT - 8}" y="{py + 4:.1f}" text-anchor="end" fill="{INK}">{escape(fmt_num(y))}</text>')
    # X ticks.
    for x in x_ticks(pts[0].seq, pts[-1].seq):
        px = sx(x)
        out.append(f'<line x1="{px:.1f}" y1="{_TOP + ph}" x2="{px:.1f}" y2="{_TOP + ph + 5}" stroke="{INK}"/>')
        out.append(f'<text x="{px:.1f}" y="{_TOP + ph + 19}" text-anchor="middle" fill="{INK}">{x}</text>')
    # Axes and their labels.
    out.append(f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + ph}" stroke="{INK}"/>')
    out.append(f'<line x1="{_LEFT}" y1="{_TOP + ph}" x2="{WIDTH - _RIGHT}" y2="{_TOP + ph}" stroke="{INK}"/>')
    out.append(f'<text x="{_LEFT + pw / 2:.1f}" y="{HEIGHT - 12}" text-anchor="middle" fill="{INK}" '
               f'font-weight="600">experiment (seq)</text>')
    out.append(f'<text transform="translate(18 {_TOP + ph / 2:.1f}) rotate(-90)" text-anchor="middle" fill="{INK}" '
               f'font-weight="600">{label}</text>')
    # Target line.
    if series.target is not None:
        ty = sy(series.target)
        out.append(f'<line class="target" x1="{_LEFT}" y1="{ty:.1f}" x2="{WIDTH - _RIGHT}" y2="{ty:.1f}" '
                   f'stroke="{AMBER}" stroke-width="1.5" stroke-dasharray="6 4"/>')
        out.append(f'<text x="{WIDTH - _RIGHT - 4}" y="{ty - 6:.1f}" text-anchor="end" fill="{AMBER}">'
                   f'{escape(series.target_label)}</text>')
    # Best-so-far step line: holds each accepted value until the next one, to the last seq.
    best = series.best
    if best:
        d = [f"M{sx(best[0].seq):.1f},{sy(best[0].value):.1f}"]
        for p in best[1:]:
            d.append(f"H{sx(p.seq):.1f}V{sy(p.value):.1f}")
        d.append(f"H{sx(pts[-1].seq):.1f}")
        out.append(f'<path class="best" d="{"".join(d)}" fill="none" stroke="{GREEN}" stroke-width="2.5" '
                   f'stroke-linejoin="round"/>')
    # Points: accepted filled green, others hollow (red when the run did not finish cleanly).
    for p in pts:
        cls = "pt pt-accepted" if p.accepted else "pt pt-other"
        colour = GREEN if p.accepted else (RED if p.status in ("error", "timeout", "rejected") else GREY)
        fill = colour if p.accepted else "#ffffff"
        tip = escape(f"{p.id} (seq {p.seq}): {fmt_num(p.value)}{' ' + series.unit if series.unit else ''}")
        out.append(f'<circle class="{cls}" cx="{sx(p.seq):.1f}" cy="{sy(p.value):.1f}" r="5.5" fill="{fill}" '
                   f'stroke="{colour}" stroke-width="2"><title>{tip}</title></circle>')
    out.append(_legend(series.target is not None))
    out.append("</svg>")
    return "\n".join(out)


def _legend(target: bool) -> str:
    items = [
        (f'<circle cx="0" cy="0" r="5" fill="{GREEN}" stroke="{GREEN}" stroke-width="2"/>'
         f'<text x="10" y="4" fill="{INK}">baseline / accepted</text>'),
        (f'<circle cx="0" cy="0" r="5" fill="#ffffff" stroke="{GREY}" stroke-width="2"/>'
         f'<text x="10" y="4" fill="{INK}">other candidate</text>'),
        (f'<line x1="-6" y1="0" x2="12" y2="0" stroke="{GREEN}" stroke-width="2.5"/>'
         f'<text x="18" y="4" fill="{INK}">best so far</text>'),
    ]
    widths = [150, 125, 100]
    if target:
        items.append(f'<line x1="-6" y1="0" x2="12" y2="0" stroke="{AMBER}" stroke-width="1.5" stroke-dasharray="6 4"/>'
                     f'<text x="18" y="4" fill="{INK}">criterion</text>')
        widths.append(90)
    x, out = _LEFT + 8, ['<g class="legend">']
    for item, w in zip(items, widths):
        out.append(f'<g transform="translate({x} 20)">{item}</g>')
        x += w
    out.append("</g>")
    return "".join(out)
