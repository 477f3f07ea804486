"""The serving probe's encode findings: inline encode that holds text requests up, and
image requests queueing for too few encode workers; the playbook's answer to each."""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Feedback
from infra_agent.probes.serving_encode import encode_findings
from infra_agent.vocabulary import FindingKind


def _run(encode_count: int, duration: float = 10.0, **keys: Any) -> dict[str, Any]:
    return {"duration": duration, "server_metrics": {"encode": {"count": encode_count, "mean_s": 0.05}},
            "text_only_p99_ttft_ms": 300.0, "text_only_median_ttft_ms": 40.0, **keys}


def test_inline_encode_is_located_at_the_engine_thread() -> None:
    fb = Feedback(probe="serving", tier="e2e")
    # 50 ms per image request, 40 of them in 10 s: the encoder had 20% of the engine thread.
    encode_findings(fb, "mixed", [_run(40)], {"encode": [50.0], "encode_queue": [30.0], "encode_transfer": [0.0]})
    (f,) = fb.findings
    assert f.kind == FindingKind.ENCODE_BLOCKS_TEXT
    assert f.location is not None and (f.location.component, f.location.span) == ("engine.encode", "encode")
    assert abs(f.evidence["encode_busy_share"] - 0.2) < 1e-9
    assert "text-only p99 TTFT 300.0 ms" in f.message


def test_encode_workers_that_fall_behind_are_a_queue_finding() -> None:
    fb = Feedback(probe="serving", tier="e2e")
    encode_findings(fb, "mixed", [_run(40)], {"encode": [50.0], "encode_queue": [120.0], "encode_transfer": [0.4]})
    (f,) = fb.findings
    assert f.kind == FindingKind.ENCODE_QUEUE_DOMINATES and f.location.span == "encode_queue"  # type: ignore[union-attr]


def test_no_images_or_a_keeping_up_encoder_is_no_finding() -> None:
    fb = Feedback(probe="serving", tier="e2e")
    encode_findings(fb, "text", [_run(0)], {"encode": [], "encode_queue": []})
    encode_findings(fb, "mixed", [_run(40)], {"encode": [50.0], "encode_queue": [5.0], "encode_transfer": [0.4]})
    # inline, but a small share of the window and text p99 under one encode
    encode_findings(fb, "light", [_run(2, text_only_p99_ttft_ms=20.0)],
                    {"encode": [50.0], "encode_queue": [1.0], "encode_transfer": [0.0]})
    assert fb.findings == []
