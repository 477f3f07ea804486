from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from infra_agent.serving.arrivals import arrival_offsets, paced


def _gaps(offsets: np.ndarray) -> np.ndarray:
    return np.diff(offsets)


def test_mean_rate_matches_request_rate() -> None:
    for burstiness in (0.5, 1.0, 4.0):
        offs = arrival_offsets(20001, request_rate=10.0, burstiness=burstiness, seed=3)
        assert offs[0] == 0.0
        assert np.all(np.diff(offs) >= 0)
        # 20000 gaps: the sample mean is within ~1.5% (4 sigma at burstiness 0.5) of 0.1 s.
        assert _gaps(offs).mean() == pytest.approx(0.1, rel=0.03)


def test_burstiness_sets_the_spread_of_gaps() -> None:
    # Gamma(shape=b): coefficient of variation is 1/sqrt(b).
    for b in (0.25, 1.0, 4.0):
        g = _gaps(arrival_offsets(20001, request_rate=5.0, burstiness=b, seed=11))
        assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(b), rel=0.08)


def test_seeded_and_infinite_rate() -> None:
    a = arrival_offsets(100, 4.0, 1.0, seed=7)
    assert np.array_equal(a, arrival_offsets(100, 4.0, 1.0, seed=7))
    assert not np.array_equal(a, arrival_offsets(100, 4.0, 1.0, seed=8))
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))
    # Infinite burstiness: the gamma's limit, gaps of exactly 1/rate (constant arrivals).
    assert np.allclose(arrival_offsets(5, 4.0, burstiness=math.inf), [0.0, 0.25, 0.5, 0.75, 1.0])
    with pytest.raises(ValueError):
        arrival_offsets(5, 1.0, burstiness=0)


def test_paced_waits_until_each_send_time() -> None:
    offsets = np.array([0.0, 0.05, 0.10, 0.15])

    async def collect() -> list[tuple[int, float]]:
        t0 = time.perf_counter()
        return [(i, time.perf_counter() - t0) async for i in paced(offsets)]

    got = asyncio.run(collect())
    assert [i for i, _ in got] == [0, 1, 2, 3]
    for (_, t), off in zip(got, offsets):
        assert t >= off - 1e-3  # never early; lateness depends on the (busy) machine
