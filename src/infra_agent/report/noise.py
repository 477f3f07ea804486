"""The noise a decision was made under: its interval's width and the machine's load.

The serving probe records, once per measurement window, the CPU that processes outside
the experiment used (``host_foreign_cpu``, in cores) and the 1-minute load average
(``host_load_1m``).  A card shows the max and the median over the experiment's windows,
both sides of the pair together, so a reader can tell a decision made on a quiet machine
from one made beside a busy neighbour.  Runs recorded before the probe measured them say
"not recorded".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from infra_agent.feedback import Feedback
from infra_agent.records import Experiment
from infra_agent.report.decisions import Decision
from infra_agent.report.fmt import fmt_num

FOREIGN_CPU = "host_foreign_cpu"
LOAD_1M = "host_load_1m"
NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class Noise:
    interval: str  # its width: "0.13 (1.12 to 1.25, ±5.6%)", or "none (an exact count)"
    foreign_cpu: str  # "max 1.8 cores, median 0.4 cores over 6 windows (3 candidate, 3 parent)", or NOT_RECORDED
    load: str
    measured: bool = True  # False: nothing ran (a rejected patch), so there is no noise to state


def _samples(fb: Feedback | None, name: str) -> tuple[list[float], str]:
    if fb is None:
        return [], ""
    found = [m for m in fb.measurements if m.name == name]
    return [s for m in found for s in m.samples if math.isfinite(s)], next((m.unit for m in found), "")


def _samples_both(e: Experiment, name: str) -> tuple[list[float], str]:
    cand, unit_c = _samples(e.feedback, name)
    ref, unit_r = _samples(e.baseline_feedback, name)
    return cand + ref, unit_c or unit_r


def _window_line(e: Experiment, name: str) -> str:
    cand, unit_c = _samples(e.feedback, name)
    ref, unit_r = _samples(e.baseline_feedback, name)
    values, unit = cand + ref, unit_c or unit_r
    if not values:
        return NOT_RECORDED
    # "load" is the measurement's own name for a load average: no unit to print.
    u = f" {unit}" if unit and unit != "load" else ""
    other = "baseline" if e.role == "confirm" else "parent"
    sides = f" ({len(cand)} candidate, {len(ref)} {other})" if cand and ref else ""
    n = len(values)
    return (f"max {fmt_num(max(values))}{u}, median {fmt_num(statistics.median(values))}{u} "
            f"over {n} window{'s' if n != 1 else ''}{sides}")


def interval_width(d: Decision | None) -> str:
    """The width of the interval the decision was made on, or "none (why)"."""
    if d is None:
        return "none (no decision)"
    if d.kind == "count":
        return "none (an exact count)"
    if d.kind == "none" or d.low is None or d.high is None:
        return "none (no ratio was measured)" if d.kind == "none" else "none (the verdict records no interval)"
    # The half-width in log space, as a percentage: the ± a reader can hold against the line.
    pm = (math.sqrt(d.high / d.low) - 1) * 100
    return f"{fmt_num(d.high - d.low)} ({fmt_num(d.low)} to {fmt_num(d.high)}, ±{pm:.1f}%)"


def load_note(e: Experiment) -> str:
    """The load in a few words, for a tooltip or a table cell ("" when not recorded)."""
    cpu, _ = _samples_both(e, FOREIGN_CPU)
    if cpu:
        return f"foreign CPU max {fmt_num(max(cpu))} cores"
    load, _ = _samples_both(e, LOAD_1M)
    return f"load max {fmt_num(max(load))}" if load else ""


def noise_of(e: Experiment, d: Decision | None) -> Noise:
    return Noise(interval=interval_width(d), foreign_cpu=_window_line(e, FOREIGN_CPU), load=_window_line(e, LOAD_1M),
                 measured=e.feedback is not None or e.baseline_feedback is not None)
