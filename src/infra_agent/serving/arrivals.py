"""When each request is sent: all at once, or gamma-distributed gaps.

vLLM convention: with a finite ``request_rate`` the gaps between sends are drawn from
a gamma distribution with shape = burstiness and scale = 1 / (rate * burstiness), so
the mean gap is always 1/rate.  Burstiness 1 is a Poisson process; below 1 requests
clump together, above 1 they are more evenly spaced, and ``inf`` (the gamma's limit)
spaces them exactly 1/rate apart: constant arrivals, the schedule other load
generators call "constant", so two clients can be given the very same send times.  ``max_concurrency`` (applied by
the runner) caps requests in flight independently of the arrival process.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import numpy as np


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send times in seconds after the window opens, one per request (non-decreasing)."""
    assert n >= 0
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    # The first request goes out at once, as in vLLM; the gaps separate the rest.
    gaps[:1] = 0.0
    return np.cumsum(gaps)


async def paced(offsets: np.ndarray) -> AsyncIterator[int]:
    """Yield request indices at their send times (relative to the first iteration)."""
    t0 = time.perf_counter()
    for i, off in enumerate(offsets):
        delay = float(off) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        yield i
