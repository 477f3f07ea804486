"""The ``step_slowdown`` calibration knob: stretch each engine step so throughput drops by a
known fraction.

A calibration target for the measurement side (does an A/B run detect a 5% regression?),
not a serving feature: it lives apart from the engine's step so the step reads as serving
alone, and the engine calls ``stretch_period`` only when the knob is set.
"""

from __future__ import annotations

import time

from infra_agent import tracing

__all__ = ["stretch_period"]


def stretch_period(slowdown: float, step_start: float, prev_start: float | None) -> None:
    """Stretch the step period so throughput drops by ``slowdown`` (``s``).

    The spin is a share of the previous step-to-step period (work, the serving
    thread's turns at the GIL, and the previous spin), so in steady state the
    period becomes (work + rest) / (1 - s): exactly a fraction s fewer steps per
    second.  After an idle wait there is no period yet; the step's own time stands
    in.  Spinning, unlike a sleep, keeps the core as slower compute would, and is
    free of the OS's wake-up latency.
    """
    s = slowdown
    # The span carries the period it stretched, so a trace (and the test) can check the
    # spin against the engine's own clock rather than span starts, which a preemption
    # between ``step_start`` and the step span's opening would shift.
    with tracing.span("step_slowdown", cat="engine") as spin:
        now = time.perf_counter()
        base = (step_start - prev_start) if prev_start is not None else (now - step_start) / (1.0 - s)
        spin.args = {"base_us": base * 1e6}  # recorded only when tracing is on
        until = now + s * base
        while time.perf_counter() < until:
            pass
