"""The goodput search settings of a scenario (``scenarios.NAME.goodput`` in ``infra-agent.yaml``).

With them, a scenario names a question instead of one load: the highest request rate at
which the server still meets the SLO (``serving/goodput.py`` searches it).  ``slo`` holds
limits on a percentile (``percentile``, default 99) of TTFT, TPOT and E2E latency, as
vLLM's auto_tune states its latency limit; a request counts toward goodput when it meets
every limit given (vLLM's ``--goodput`` definition).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from infra_agent.workspace._base import _Strict


class SloLimits(_Strict):
    """Latency limits in milliseconds on one percentile of each metric; at least one is given."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_limit(self) -> SloLimits:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("give at least one of ttft_ms, tpot_ms, e2el_ms")
        return self

    def limits(self) -> dict[str, float]:
        """metric (ttft, tpot, e2el) -> limit in ms, for the limits given."""
        return {m: v for m, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms)) if v is not None}


class GoodputSearch(_Strict):
    """How to search the highest request rate that meets the SLO."""

    slo: SloLimits
    # The percentile each limit applies to: 99 reads "p99 TTFT <= ttft_ms".
    percentile: float = Field(99.0, gt=0, le=100)
    # The bracket: the lowest rate worth trying, and the highest (None: the throughput the
    # server reaches with every request sent at once, measured first, as auto_tune does).
    rate_min: float = Field(0.5, gt=0)
    rate_max: float | None = Field(None, gt=0)
    # Stop bisecting when the bracket [meets, misses] is this narrow relative to its top.
    tolerance: float = Field(0.15, gt=0, lt=1)
    max_rates: int = Field(8, ge=2, le=50)  # rates tried in all, the bracket's ends included
    # Windows per rate: at least min_windows (the judge decides nothing on fewer than 3),
    # one more at a time while the interval straddles a limit, up to max_windows.
    min_windows: int = Field(3, ge=3, le=50)
    max_windows: int = Field(6, ge=3, le=100)
    confidence: float = Field(0.95, gt=0.5, lt=1)

    @model_validator(mode="after")
    def _ordered(self) -> GoodputSearch:
        if self.max_windows < self.min_windows:
            raise ValueError(f"max_windows ({self.max_windows}) must be >= min_windows ({self.min_windows})")
        if self.rate_max is not None and self.rate_max <= self.rate_min:
            raise ValueError(f"rate_max ({self.rate_max:g}) must be above rate_min ({self.rate_min:g})")
        return self
