"""The serving probe's findings about an image encode stage (refstack's encode phases).

Two patterns, from the server's encode histograms (``encode_queue``, ``encode``,
``encode_transfer`` in ``serving/phases.py``) and the client's text-only latencies
(``text_only_*`` keys of a multimodal window):

- ``encode_blocks_text``: images are encoded inline (no embedding transfer: the
  encoder runs on the engine's own thread), so every step that encodes holds up the
  text requests batched or queued with it.  Reported when the encoder's time is a
  visible share of the window or of the text requests' p99 TTFT.
- ``encode_queue_dominates``: encode runs elsewhere (embeddings are transferred), but
  image requests wait longer for an encoder than the encoding takes.
"""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Feedback, Finding, Location
from infra_agent.vocabulary import FindingKind

# The encoder's busy share of the window above which inline encoding is reported.
INLINE_SHARE = 0.1


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def encode_findings(fb: Feedback, name: str, ok: list[dict[str, Any]], phases: dict[str, list[float]]) -> None:
    encode, queue, transfer = (_mean(phases.get(p, [])) for p in ("encode", "encode_queue", "encode_transfer"))
    if not encode:
        return  # no image request in the window, or a server without an encode stage
    counts = [int((r.get("server_metrics") or {}).get("encode", {}).get("count") or 0) for r in ok]
    durations = [float(r.get("duration") or 0.0) for r in ok]
    busy = sum(encode * n for n, d in zip(counts, durations) if d > 0) / max(1e-9, sum(d * 1e3 for d in durations))
    text_p99 = _mean([float(r["text_only_p99_ttft_ms"]) for r in ok if r.get("text_only_p99_ttft_ms") is not None])
    text_median = _mean([float(r["text_only_median_ttft_ms"]) for r in ok
                         if r.get("text_only_median_ttft_ms") is not None])
    evidence: dict[str, Any] = {"encode_ms": encode, "encode_queue_ms": queue, "encode_transfer_ms": transfer,
                                "encode_busy_share": busy, "text_only_p99_ttft_ms": text_p99,
                                "text_only_median_ttft_ms": text_median, "scenario": name}
    inline = transfer is not None and transfer <= 1e-6
    if inline and (busy >= INLINE_SHARE or (text_p99 is not None and text_p99 >= encode)):
        text = (f"; text-only p99 TTFT {text_p99:.1f} ms (median {text_median:.1f} ms)"
                if text_p99 is not None and text_median is not None else "")
        fb.findings.append(Finding(
            kind=FindingKind.ENCODE_BLOCKS_TEXT, severity="warning",
            message=(f"text requests wait behind inline image encoding in {name}: the engine thread encodes "
                     f"{encode:.1f} ms per image request, {busy:.0%} of the window{text}"),
            location=Location(component="engine.encode", span="encode"), evidence=evidence,
            next_question=("Would encoding images on their own workers (encode disaggregation), off the engine "
                           "thread, keep text requests from waiting behind the encoder?"),
        ))
    elif not inline and queue is not None and queue > encode:
        fb.findings.append(Finding(
            kind=FindingKind.ENCODE_QUEUE_DOMINATES, severity="warning",
            message=(f"image requests wait {queue:.1f} ms for an encoder, longer than the {encode:.1f} ms it "
                     f"takes to encode them, in {name}"),
            location=Location(component="engine.encode", span="encode_queue"), evidence=evidence,
            next_question="Are there too few encode workers, or is their batch too small, for this image rate?",
        ))
