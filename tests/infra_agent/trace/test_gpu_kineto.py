"""A Kineto trace recorded on an H200 beside our span trace: refstack ``--device cuda``
(``tiny``), one completion of 4 tokens, the window traced by ``--trace true`` and
profiled by ``POST /start_profile`` ... ``/stop_profile`` at once (both gzipped in
``data/``; how they were recorded: docs/timeline.md, "GPU streams").  The GPU side is loaded, put on our clock, and analysed:
kernels on their stream's track inside the engine's steps, the stream in the thread
table and the overlap matrix, its busy share of the steps, and the launch-bound finding.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from infra_agent.trace.analyze import analyze
from infra_agent.trace.feedback import timeline_feedback
from infra_agent.trace.load import TraceLoadError, load_timeline
from infra_agent.vocabulary import FindingKind

DATA = Path(__file__).with_name("data")
SPANS, KINETO = DATA / "h200-refstack-tiny.spans.json.gz", DATA / "h200-refstack-tiny.kineto.json.gz"


def test_h200_kernels_land_inside_the_engine_steps_on_one_clock() -> None:
    tl = load_timeline([SPANS], kineto=[KINETO])  # gzip is read as is
    assert [s["format"] for s in tl.sources] == ["ours", "kineto"]
    assert tl.sources[1]["clock"]["how"].startswith("Kineto baseTimeNanoseconds")
    kernels = [s for s in tl.gpu_spans() if s.cat == "kernel"]
    assert len(kernels) > 500 and {s.thread.strip() for s in kernels} == {"stream 7"}
    steps = [s for s in tl.span_sources() if s.name == "engine.step"]
    assert len(steps) == 4  # prefill and three decode steps of the one request
    # The two clocks are independent (Kineto's base time; our tracer's unix origin), yet
    # almost every kernel starts inside a step (a kernel still running as a step ends is
    # queued work the step did not wait for): < 2 ms of slack at the edges.
    lo, hi = min(s.start_us for s in steps), max(s.end_us for s in steps)
    inside = [k for k in kernels if lo - 2000 <= k.start_us <= hi + 2000]
    assert len(inside) >= 0.99 * len(kernels)


def test_the_stream_is_analysed_beside_the_threads_and_found_launch_bound() -> None:
    report = analyze(load_timeline([SPANS], kineto=[KINETO]))
    assert len(report.streams) == 1
    stream = report.streams[0]
    assert stream.stream == "stream 7" and stream.reference == "engine.step" and stream.kernels > 500
    # tiny on an H200: microsecond kernels behind a Python step, the GPU mostly idle.
    assert 0 < stream.busy_share < 0.5 and stream.median_kernel_us < 20
    assert any(t.thread.strip() == "stream 7" for t in report.threads)
    assert any(g.startswith("kernel@stream 7") for g in report.overlap.groups), list(report.overlap.groups)[:8]
    fb = timeline_feedback(report)
    found = [f for f in fb.findings if f.kind == FindingKind.LAUNCH_BOUND]
    assert len(found) == 1 and "stream 7" in found[0].message and "launch-bound" in found[0].message
    assert found[0].location is not None and found[0].location.thread == "stream 7"
    busy = [m for m in fb.measurements if m.name == "gpu_busy_share"]
    assert len(busy) == 1 and busy[0].value == pytest.approx(stream.busy_share)
    # The host's busiest thread is still named as such (the stream is not a host thread).
    assert all("stream" not in f.message for f in fb.findings if f.kind == FindingKind.THREAD_IDLE)


def test_a_truncated_gzip_names_the_file(tmp_path: Path) -> None:
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(KINETO.read_bytes()[:5000])
    with pytest.raises(TraceLoadError, match=r"cut\.json\.gz: not a complete gzip stream"):
        load_timeline([SPANS], kineto=[cut])
    whole = json.loads(gzip.decompress(KINETO.read_bytes()))
    assert whole["traceEvents"]  # the fixture itself is whole
