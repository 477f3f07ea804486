"""The decisions plot as inline SVG: each experiment's paired ratio against its parent.

One column per decided experiment (by seq).  A ratio is a marker with its interval as an
error bar, on a log axis centred at 1.0 (a higher ratio is drawn higher); beside it, a
dashed tick at the line its hypothesis needed and a light band on the side the whole
interval must reach for "supported".  Counts (decided exactly, not as ratios) and
experiments without a number get rows of their own under the axis.  Outcomes differ in
marker shape as well as colour, so the plot reads in greyscale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape

from infra_agent.report.decisions import OUTCOME_LABELS, Decision, Decisions
from infra_agent.report.fmt import fmt_num
from infra_agent.report.plot import (
    AMBER,
    GREEN,
    GRID,
    INK,
    RED,
    nice_step,
    x_ticks,
)

BLUE, DARK, GRID_TEXT = "#0969da", "#57606a", "#6e7781"
WIDTH = 880
_LEFT, _RIGHT, _TOP, _PH, _LANE = 84, 28, 72, 260, 28
_MAX_RATIO = 8.0  # a wider axis would flatten every ordinary interval; beyond it a bar is clipped
COLOURS = {"accepted": GREEN, "held": BLUE, "refuted": RED, "inconclusive": AMBER, "error": DARK,
           "confirmed": GREEN, "not_confirmed": RED}


def marker(outcome: str, x: float, y: float, r: float = 5.5) -> str:
    """The outcome's shape: ● accepted, ◆ held back, ✕ refuted, ○ inconclusive, △ error, ★ confirmation."""
    c = COLOURS[outcome]
    if outcome == "accepted":
        return f'<circle class="marker" cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{c}" stroke="{c}" stroke-width="2"/>'
    if outcome == "inconclusive":
        return f'<circle class="marker" cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="#ffffff" stroke="{c}" stroke-width="2"/>'
    if outcome == "held":
        d = r * 1.35
        return (f'<path class="marker" d="M{x:.1f},{y - d:.1f}L{x + d:.1f},{y:.1f}L{x:.1f},{y + d:.1f}'
                f'L{x - d:.1f},{y:.1f}Z" fill="{c}" stroke="{c}" stroke-width="1.5"/>')
    if outcome == "refuted":
        d = r * 0.95
        return (f'<path class="marker" d="M{x - d:.1f},{y - d:.1f}L{x + d:.1f},{y + d:.1f}M{x - d:.1f},{y + d:.1f}'
                f'L{x + d:.1f},{y - d:.1f}" stroke="{c}" stroke-width="3" stroke-linecap="round"/>')
    if outcome == "error":
        d = r * 1.2
        return (f'<path class="marker" d="M{x:.1f},{y - d:.1f}L{x + d:.1f},{y + d * 0.8:.1f}L{x - d:.1f},{y + d * 0.8:.1f}Z" '
                f'fill="#ffffff" stroke="{c}" stroke-width="2"/>')
    # A star for the confirmation: filled when it confirmed.
    pts = []
    for i in range(10):
        rad = r * (1.7 if i % 2 == 0 else 0.75)
        a = -math.pi / 2 + i * math.pi / 5
        pts.append(f"{x + rad * math.cos(a):.1f},{y + rad * math.sin(a):.1f}")
    fill = c if outcome == "confirmed" else "#ffffff"
    return f'<polygon class="marker" points="{" ".join(pts)}" fill="{fill}" stroke="{c}" stroke-width="1.8"/>'


def half_range(items: list[Decision]) -> float:
    """Half the log-axis span: symmetric about 1.0, wide enough for every point, interval and line."""
    values = [v for d in items for v in (d.effect, d.low, d.high, d.threshold) if v is not None and v > 0]
    m = max((abs(math.log(v)) for v in values), default=0.0) * 1.12
    return min(max(m, math.log(1.06)), math.log(_MAX_RATIO))


def y_ticks(m: float) -> list[float]:
    """Round ratios inside [e^-m, e^m]: steps of 1, 2 or 5 % (or more) near 1, powers of 2 when wide."""
    hi, lo = math.exp(m), math.exp(-m)
    if hi > 2.2:
        k = math.floor(math.log2(hi))
        return [2.0**i for i in range(-k, k + 1)]
    step = nice_step((hi - 1) * (1 - 1e-9), 3)  # exp(log(x)) overshoots x by an ulp: not a wider step
    up = [1 + i * step for i in range(1, int((hi - 1) / step + 1e-9) + 1)]
    down = [1 - i * step for i in range(1, int((1 - lo) / step + 1e-9) + 1)]
    return sorted([round(t, 9) for t in down + [1.0] + up])


def _legend() -> str:
    rows = [
        [(o, OUTCOME_LABELS[o], w) for o, w in (("accepted", 100), ("held", 160), ("refuted", 90),
                                                 ("inconclusive", 115), ("error", 190))],
        [("confirmed", "confirmation (best vs baseline)", 230)],
    ]
    out, y = ['<g class="legend">'], 18
    for row in rows:
        x = _LEFT + 8
        for outcome, label, w in row:
            out.append(f'<g transform="translate({x} {y})">{marker(outcome, 0, 0, 4.5)}'
                       f'<text x="11" y="4" fill="{INK}">{escape(label)}</text></g>')
            x += w
        y += 22
    x = _LEFT + 8 + 230
    out.append(f'<g transform="translate({x} 40)"><rect x="-6" y="-7" width="14" height="14" fill="{GREEN}" '
               f'fill-opacity="0.12"/><line x1="-6" y1="-7" x2="8" y2="-7" stroke="{AMBER}" stroke-width="2" '
               f'stroke-dasharray="4 2"/><text x="14" y="4" fill="{INK}">the line its hypothesis needed; '
               f"shaded: the side a supported interval lies on</text></g>")
    out.append("</g>")
    return "".join(out)


def render_ratio_svg(decisions: Decisions) -> str:
    """The plot, or "" when nothing was decided (the caller shows ``decisions.note``)."""
    items = sorted(decisions.items, key=lambda d: (d.seq, d.id))
    if not items:
        return ""
    ratios = decisions.ratios
    lanes = [(name, rows) for name, rows in (("exact count", decisions.counts), ("no ratio", decisions.unmeasured))
             if rows]
    ph = _PH if ratios else 64  # no ratio decided yet (only counts, only errors): a short, labelled panel
    height = _TOP + ph + len(lanes) * _LANE + 76
    x0, x1 = items[0].seq, items[-1].seq
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    pw = WIDTH - _LEFT - _RIGHT
    m = half_range(ratios)
    mid = _TOP + ph / 2
    hw = min(16.0, max(4.0, (pw - 40) / max(1, x1 - x0) * 0.38))
    pad = hw + 6  # the first and last columns' bands stay inside the axes

    def sx(x: float) -> float:
        return _LEFT + pad + (x - x0) / (x1 - x0) * (pw - 2 * pad)

    def sy(r: float) -> float:
        v = max(-m, min(m, math.log(r)))
        return mid - v / m * (ph / 2)

    out = [(f'<svg class="ratios" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
            f'height="{height}" role="img" aria-label="each experiment\'s ratio against its parent" '
            f'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif" font-size="12">'),
           f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>']
    for t in y_ticks(m) if ratios else [1.0]:
        py = sy(t)
        one = abs(t - 1) < 1e-12
        out.append(f'<line class="{"unity" if one else "grid"}" x1="{_LEFT}" y1="{py:.1f}" x2="{WIDTH - _RIGHT}" '
                   f'y2="{py:.1f}" stroke="{INK if one else GRID}" stroke-width="{1.5 if one else 1}"/>')
        out.append(f'<text x="{_LEFT - 8}" y="{py + 4:.1f}" text-anchor="end" fill="{INK}">{t:.4g}</text>')
    bottom = _TOP + ph
    if not ratios:
        out.append(f'<text x="{_LEFT + pw / 2:.1f}" y="{mid - 10:.1f}" text-anchor="middle" fill="{GRID_TEXT}">'
                   "no experiment was decided on a ratio yet</text>")
    out.append(f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{bottom}" stroke="{INK}"/>')
    out.append(f'<line x1="{_LEFT}" y1="{bottom}" x2="{WIDTH - _RIGHT}" y2="{bottom}" stroke="{INK}"/>')
    out.append(f'<text transform="translate(18 {mid:.1f}) rotate(-90)" text-anchor="middle" fill="{INK}" '
               f'font-weight="600">{"ratio to the parent (log scale)" if ratios else "ratio"}</text>')
    for d in ratios:
        out.append(_ratio_column(d, sx(d.seq), sy, hw, bottom))
    for i, (name, rows) in enumerate(lanes):
        ly = bottom + i * _LANE + _LANE / 2 + 4
        out.append(f'<line x1="{_LEFT}" y1="{ly + _LANE / 2:.1f}" x2="{WIDTH - _RIGHT}" y2="{ly + _LANE / 2:.1f}" '
                   f'stroke="{GRID}"/>')
        out.append(f'<text x="{_LEFT - 8}" y="{ly + 4:.1f}" text-anchor="end" fill="{INK}">{escape(name)}</text>')
        for d in rows:
            out.append(_lane_cell(d, sx(d.seq), ly))
    axis = bottom + len(lanes) * _LANE
    for x in x_ticks(items[0].seq, items[-1].seq):
        px = sx(x)
        out.append(f'<line x1="{px:.1f}" y1="{axis}" x2="{px:.1f}" y2="{axis + 5}" stroke="{INK}"/>')
        out.append(f'<text x="{px:.1f}" y="{axis + 19}" text-anchor="middle" fill="{INK}">{x}</text>')
    # The confirmation is named under its column: it is the best against the baseline, not a step.
    for d in items:
        if d.confirm:
            out.append(f'<text class="confirm-label" x="{sx(d.seq):.1f}" y="{axis + 34}" text-anchor="middle" '
                       f'fill="{INK}" font-weight="600">confirm</text>')
    out.append(f'<text x="{_LEFT + pw / 2:.1f}" y="{height - 12}" text-anchor="middle" fill="{INK}" '
               f'font-weight="600">experiment (seq)</text>')
    out.append(_legend())
    out.append("</svg>")
    return "\n".join(out)


def _ratio_column(d: Decision, x: float, sy: Callable[[float], float], hw: float, bottom: float) -> str:
    assert d.effect is not None
    parts = [f'<g class="decision d-{d.outcome}" data-exp="{escape(d.id)}" data-outcome="{d.outcome}">',
             f"<title>{escape(d.describe())}</title>"]
    if d.threshold is not None:
        ty = sy(d.threshold)
        top, h = (_TOP, ty - _TOP) if d.direction == "higher" else (ty, bottom - ty)
        parts.append(f'<rect class="zone" x="{x - hw:.1f}" y="{top:.1f}" width="{2 * hw:.1f}" height="{max(0.0, h):.1f}" '
                     f'fill="{GREEN}" fill-opacity="0.12"/>')
        parts.append(f'<line class="threshold" x1="{x - hw - 2:.1f}" y1="{ty:.1f}" x2="{x + hw + 2:.1f}" y2="{ty:.1f}" '
                     f'stroke="{AMBER}" stroke-width="2" stroke-dasharray="4 2"/>')
    c = COLOURS[d.outcome]
    if d.low is not None and d.high is not None:
        hi_y, lo_y = sy(d.high), sy(d.low)
        cap = min(6.0, hw * 0.6)
        parts.append(f'<line class="ebar" x1="{x:.1f}" y1="{hi_y:.1f}" x2="{x:.1f}" y2="{lo_y:.1f}" stroke="{c}" '
                     f'stroke-width="2"/>')
        for cy in (hi_y, lo_y):
            parts.append(f'<line class="cap" x1="{x - cap:.1f}" y1="{cy:.1f}" x2="{x + cap:.1f}" y2="{cy:.1f}" '
                         f'stroke="{c}" stroke-width="2"/>')
    parts.append(marker(d.outcome, x, sy(d.effect)))
    parts.append("</g>")
    return "".join(parts)


def _lane_cell(d: Decision, x: float, y: float) -> str:
    value = fmt_num(d.effect) if d.kind == "count" else ""
    text = f'<text x="{x + 9:.1f}" y="{y + 4:.1f}" fill="{INK}" font-size="11">{escape(value)}</text>' if value else ""
    return (f'<g class="decision d-{d.outcome} lane-{d.kind}" data-exp="{escape(d.id)}" data-outcome="{d.outcome}">'
            f"<title>{escape(d.describe())}</title>{marker(d.outcome, x, y, 4.5)}{text}</g>")
