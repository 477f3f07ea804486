"""Numbers, times and durations as the report prints them."""

from __future__ import annotations

import math
from datetime import datetime, timezone


def fmt_num(x: float | None) -> str:
    """A number for people: 4 significant digits, thousands grouped above 10 000."""
    if x is None or not math.isfinite(x):
        return "–"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 and abs(x) < 1e12:
        return f"{x:,.0f}"
    if abs(x) < 1e-3 or abs(x) >= 1e12:
        return f"{x:.3e}"
    return f"{x:.4g}"


def fmt_interval(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f"[{fmt_num(low)}, {fmt_num(high)}]"


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "–"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"
