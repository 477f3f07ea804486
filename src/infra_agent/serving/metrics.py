"""vLLM-compatible serving metrics from per-request records.

Definitions (ANCHORS.md, "Serving-benchmark conventions"), computed as ``vllm bench
serve`` computes them by default (``timing.py`` says what a token event is under the
``vllm`` and ``content`` latency definitions; the other one is reported beside, labelled):

- TTFT: send -> first token event.  TPOT: (E2EL - TTFT) / (output_len - 1), and only
  for requests with more than one output token (a one-token answer has no decode);
  output_len is the server's ``usage.completion_tokens``.
- ITL: every gap between successive token events, pooled across requests.
- Failed requests are counted in ``failed`` and listed in ``errors``, but never enter a
  latency or throughput number: a fast failure would otherwise flatter the latency
  and a slow one would skew it.
- Percentiles are computed from the raw samples, never from histograms.
- Goodput: requests per second that met *every* SLO given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from infra_agent.serving.client import RequestRecord
from infra_agent.serving.timing import LatencyDefinition

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


def timeline(rec: RequestRecord, definition: LatencyDefinition = "vllm") -> tuple[float, list[float], float] | None:
    """(TTFT, ITL gaps, E2EL) in seconds under ``definition``; None when it has none.

    A failed request has none; under ``content``, neither has an answer without text.
    """
    if not rec.success:
        return None
    if definition == "vllm":
        return rec.ttft, rec.itl, rec.latency
    if rec.content_ttft is None or rec.content_latency is None:
        return None
    return rec.content_ttft, rec.content_itl, rec.content_latency


def tpot_of(rec: RequestRecord, definition: LatencyDefinition = "vllm") -> float | None:
    """Seconds per output token after the first, or None when there is no decode."""
    t = timeline(rec, definition)
    if t is None or rec.output_len <= 1:
        return None
    return (t[2] - t[0]) / (rec.output_len - 1)


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def meets_slo(rec: RequestRecord, slo: SLO, definition: LatencyDefinition = "vllm") -> bool:
    t = timeline(rec, definition)
    if t is None:
        return False  # nothing to hold against a limit (failed, or no text under ``content``)
    ttft, _, latency = t
    if slo.ttft_ms is not None and ttft * 1e3 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None:
        # A one-token answer has no decode phase, so it cannot violate a TPOT limit.
        tpot = tpot_of(rec, definition)
        if tpot is not None and tpot * 1e3 > slo.tpot_ms:
            return False
    if slo.e2el_ms is not None and latency * 1e3 > slo.e2el_ms:
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


def latency_stats(records: Sequence[RequestRecord], definition: LatencyDefinition,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """``{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms`` under one definition, and how many
    requests it timed (``timed``)."""
    timed = [(r, t) for r in records if (t := timeline(r, definition)) is not None]
    tpots = [x for x in (tpot_of(r, definition) for r, _ in timed) if x is not None]
    out: dict[str, Any] = {}
    for name, samples in (("ttft", [t[0] for _, t in timed]), ("tpot", tpots),
                          ("itl", [g for _, t in timed for g in t[1]]), ("e2el", [t[2] for _, t in timed])):
        out.update(_stats(name, samples, percentiles))
    out["timed"] = len(timed)
    return out


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    slo: SLO | None = None,
    definition: LatencyDefinition = "vllm",
) -> dict[str, Any]:
    """The vLLM-style result dict for one measured window of ``duration`` seconds.

    The latency keys follow ``definition``; the other definition's statistics go under
    ``<other>_latency`` (e.g. ``content_latency``), so both readings of one run sit side
    by side.
    """
    assert duration > 0, "a window must have a positive duration"
    ok = [r for r in records if r.success]
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
        result["request_goodput"] = sum(1 for r in ok if meets_slo(r, slo, definition)) / duration
        result["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms}
    main = latency_stats(records, definition, percentiles)
    main.pop("timed")
    result.update(main)
    result["latency_definition"] = definition
    other: LatencyDefinition = "content" if definition == "vllm" else "vllm"
    result[f"{other}_latency"] = latency_stats(records, other, percentiles)
    # Per-request lists keep request order; failed requests appear with zeros and their
    # error text so the lists stay aligned, but the summary numbers above exclude them.
    # Under ``content``, a completed answer without text has null timings.
    lines = [timeline(r, definition) for r in records]
    result["input_lens"] = [r.prompt_len for r in records]
    # Each request's send time as unix seconds, to line requests up with what the server
    # did meanwhile (a trace, a profile, event-loop stalls).  The client times requests on
    # perf_counter (monotonic); one offset taken now maps it to the wall clock, which moves
    # apart from it by far less than a millisecond over a window unless the clock is set.
    to_unix = time.time() - time.perf_counter()
    result["start_times"] = [r.start + to_unix for r in records]
    result["output_lens"] = [r.output_len if r.success else 0 for r in records]
    result["ttfts"] = [t[0] if t else (None if r.success else 0.0) for r, t in zip(records, lines)]
    result["itls"] = [list(t[1]) if t else [] for t in lines]
    result["e2els"] = [t[2] if t else (None if r.success else 0.0) for r, t in zip(records, lines)]
    result["errors"] = [r.error for r in records]
    result["answer_lengths"] = answer_lengths(records)
    if any(r.num_images for r in records):
        # A multimodal window: the image count per request, and the text-only and image
        # requests' latencies apart (``text_only_p99_ttft_ms``, ``image_p99_ttft_ms``, ...):
        # an encode stage can hold text requests up behind images.
        result["num_images"] = [r.num_images for r in records]
        for prefix, part in (("text_only_", [r for r in records if not r.num_images]),
                             ("image_", [r for r in records if r.num_images])):
            stats = latency_stats(part, definition, percentiles)
            result[prefix + "requests"] = stats.pop("timed")
            result.update({prefix + k: v for k, v in stats.items()})
    return result


def answer_lengths(records: Sequence[RequestRecord]) -> dict[str, int]:
    """How many completed answers had the length they were asked for.

    With ``ignore_eos`` the request fixes the answer's length (``max_tokens``), so an answer
    shorter than asked (a server that stops early) or longer (one that ignores
    ``max_tokens``) is a server not doing the work it is timed on: its latencies and
    throughput flatter it.  Counted only where the server reported its usage (a streamed
    chunk may carry several tokens, so chunks counted are no length)."""
    asked = [r for r in records if r.success and r.ignore_eos and r.max_tokens > 0 and r.output_from_usage]
    return {"checked": len(asked), "short": sum(r.output_len < r.max_tokens for r in asked),
            "long": sum(r.output_len > r.max_tokens for r in asked)}


def request_samples(result: dict[str, Any], metric: str) -> list[float]:
    """Per-request samples (ms) of a latency metric from a stored result, failures excluded.

    ``metric`` is a base name (``ttft``, ``tpot``, ``itl``, ``e2el``).  Used by the judge to
    bootstrap a single run's statistics.
    """
    errors = result.get("errors") or [""] * len(result.get("ttfts", []))
    # A null TTFT is a completed answer that the result's definition could not time.
    ok = [i for i, e in enumerate(errors) if not e and result["ttfts"][i] is not None]
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
