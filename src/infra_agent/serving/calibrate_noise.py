"""Measure the spread between two fresh server processes of one configuration (A/A blocks).

The loop starts fresh servers for every batch of pairs, so its interval must carry the
per-process offset that pairs inside one batch share (stats/process_noise.py).  This
runs ``blocks`` A/A blocks of the workspace's baseline configuration, each on two freshly
started servers with ``pairs`` interleaved windows (ABBA order, the side started first
alternating), and estimates that spread per metric: the workspace criteria's metrics,
and the throughput and latency statistics the benchmark reports under vLLM's names.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

from infra_agent.serving.interleave import interleave_knobs
from infra_agent.serving.noise_record import Machine, MetricNoise, NoiseCalibration
from infra_agent.stats.process_noise import between_process_spread
from infra_agent.target.host_load import loadavg
from infra_agent.workspace.models import Workspace

# The benchmark's own rate and latency statistics (vLLM's names); standard deviations and
# counts are left out: a spread of a spread, or a number fixed by the scenario.
_STAT = re.compile(r"^(?:request_throughput|output_throughput|total_token_throughput|"
                   r"(?:mean|median|p\d+(?:\.\d+)?)_(?:ttft|tpot|itl|e2el)_ms)$")

OnWindow = Callable[[int, int, str], None]  # (block, window index in it, side)


def calibrated_metrics(ws: Workspace, scenario: str, results: list[dict[str, Any]]) -> list[str]:
    """The criteria's metrics on ``scenario`` and the benchmark's statistics every window reported."""
    names = [c.metric for c in ws.criteria if getattr(c, "check", None) is None and c.scenario in (None, scenario)]
    if results:
        names += sorted(k for k in results[0] if _STAT.match(k))
    return [n for n in dict.fromkeys(names) if all(_positive(r.get(n)) for r in results)]


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _rounded(load: float | None) -> float | None:
    return None if load is None else round(load, 2)


def calibrate(ws: Workspace, scenario: str, *, blocks: int = 6, pairs: int = 3,
              on_window: OnWindow | None = None) -> NoiseCalibration:
    """A/A blocks of the baseline configuration; the spread between processes per metric."""
    if blocks < 2:
        raise ValueError(f"blocks: at least 2 fresh process pairs are needed to see a spread between them, got {blocks}")
    if pairs < 2:
        raise ValueError(f"pairs: at least 2 windows per block are needed for the within-block noise, got {pairs}")
    knobs = ws.resolve_knobs({})
    load_before, t0 = _rounded(loadavg()), time.monotonic()

    def seen(side: str, i: int, _result: dict[str, Any]) -> None:
        if on_window is not None:
            on_window(i // pairs, i % pairs, side)

    runs = interleave_knobs(ws, knobs, knobs, blocks * pairs, scenario_name=scenario, order="abba",
                            restarts=blocks, on_run=seen)
    a, b = runs.complete_pairs()
    metrics = calibrated_metrics(ws, scenario, a + b)
    out: dict[str, MetricNoise] = {}
    for name in metrics:
        by_block: dict[int, list[float]] = {}
        for ra, rb in zip(a, b, strict=True):
            by_block.setdefault(int(ra.get("restart", 0)), []).append(math.log(float(rb[name]) / float(ra[name])))
        try:
            s = between_process_spread(list(by_block.values()))
        except ValueError:
            continue  # too few complete pairs survived for this metric
        out[name] = MetricNoise(tau=s.tau, within_sd=s.within_sd, f=None if math.isnan(s.f) else s.f, df=s.df,
                                p=None if math.isnan(s.p) else s.p, blocks=s.blocks, pairs=s.pairs)
    if not out:
        raise ValueError(f"no metric could be calibrated: {len(a)} complete pair(s) of {blocks * pairs} in "
                         f"scenario {scenario!r}")
    return NoiseCalibration(scenario=scenario, machine=Machine.here(), blocks=blocks, pairs_per_block=pairs,
                            wall_s=time.monotonic() - t0, load_before=load_before, load_after=_rounded(loadavg()), metrics=out)


__all__ = ["calibrate", "calibrated_metrics"]
