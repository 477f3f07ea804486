"""vLLM-compatible serving metrics from per-request records.

Definitions (ANCHORS.md, "Serving-benchmark conventions"):

- TTFT: send -> first content token.  TPOT: (E2EL - TTFT) / (output_len - 1), and only
  for requests with more than one output token (a one-token answer has no decode).
- ITL: every gap between successive content chunks, pooled across requests.
- Failed requests are counted in ``failed`` and listed in ``errors``, but never enter a
  latency or throughput number: a fast failure would otherwise flatter the latency
  and a slow one would skew it.
- Percentiles are computed from the raw samples, never from histograms.
- Goodput: requests per second that met *every* SLO given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infra_agent.bench.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES: tuple[float, ...] = (99.0,)


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-request service-level objectives in milliseconds; None means 'no limit'."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None


def tpot_of(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first, or None when there is no decode."""
    if not rec.success or rec.output_len <= 1:
        return None
    return (rec.latency - rec.ttft) / (rec.output_len - 1)


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def meets_slo(rec: RequestRecord, slo: SLO) -> bool:
    if not rec.success:
        return False
    if slo.ttft_ms is not None and rec.ttft * 1e3 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None:
        # A one-token answer has no decode phase, so it cannot violate a TPOT limit.
        tpot = tpot_of(rec)
        if tpot is not None and tpot * 1e3 > slo.tpot_ms:
            return False
    if slo.e2el_ms is not None and rec.latency * 1e3 > slo.e2el_ms:
        return False
    return True


def _stats(name: str, samples_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    out: dict[str, float] = {}
    if ms.size == 0:
        # No sample: report 0 like vLLM does, the counts make the emptiness visible.
        out[f"mean_{name}_ms"] = out[f"median_{name}_ms"] = out[f"std_{name}_ms"] = 0.0
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = 0.0
        return out
    out[f"mean_{name}_ms"] = float(ms.mean())
    out[f"median_{name}_ms"] = float(np.median(ms))
    out[f"std_{name}_ms"] = float(ms.std())
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    slo: SLO | None = None,
) -> dict[str, Any]:
    """The vLLM-style result dict for one measured window of ``duration`` seconds."""
    assert duration > 0, "a window must have a positive duration"
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)

    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": None,
    }
    if slo is not None and not slo.empty:
        result["request_goodput"] = sum(1 for r in ok if meets_slo(r, slo)) / duration
        result["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms}
    for name, samples in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(name, samples, percentiles))
    # Per-request lists keep request order; failed requests appear with zeros and their
    # error text so the lists stay aligned, but the summary numbers above exclude them.
    result["input_lens"] = [r.prompt_len for r in records]
    result["output_lens"] = [r.output_len if r.success else 0 for r in records]
    result["ttfts"] = [r.ttft if r.success else 0.0 for r in records]
    result["itls"] = [list(r.itl) if r.success else [] for r in records]
    result["e2els"] = [r.latency if r.success else 0.0 for r in records]
    result["errors"] = [r.error for r in records]
    return result


def request_samples(result: dict[str, Any], metric: str) -> list[float]:
    """Per-request samples (ms) of a latency metric from a stored result, failures excluded.

    ``metric`` is a base name (``ttft``, ``tpot``, ``itl``, ``e2el``).  Used by the judge to
    bootstrap a single run's statistics.
    """
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    ok = [i for i, e in enumerate(errors) if not e]
    if metric == "ttft":
        return [result["ttfts"][i] * 1e3 for i in ok]
    if metric == "e2el":
        return [result["e2els"][i] * 1e3 for i in ok]
    if metric == "itl":
        return [g * 1e3 for i in ok for g in result["itls"][i]]
    if metric == "tpot":
        out = []
        for i in ok:
            n = result["output_lens"][i]
            if n > 1:
                out.append((result["e2els"][i] - result["ttfts"][i]) / (n - 1) * 1e3)
        return out
    raise KeyError(f"no per-request samples for {metric!r}; expected one of {LATENCY_METRICS}")
