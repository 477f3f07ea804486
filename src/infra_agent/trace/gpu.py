"""GPU streams from a Kineto trace: how busy each stream was while the engine stepped.

A PyTorch profiler trace recorded on a GPU carries the device's own activity: ``kernel``,
``gpu_memcpy`` and ``gpu_memset`` events on ``stream N`` tracks (Kineto's ``pid`` is the
device, ``tid`` the stream).  Unlike the host's ``cpu_op`` events, which repeat what our
spans already say at a finer grain, these are the other side of the timeline: a stream
that is idle while the engine's steps run is a GPU waiting on the host that feeds it
(kernel launches, Python between them), which no host-side span can show.

The reference interval is the union of the engine's step spans when the trace has them
(``engine.step``), else the window: a stream's busy share of it is the GPU's utilisation
during the steps, the figure a launch-bound decode step gives away.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from infra_agent.trace.intervals import Interval, clip, intersect, merge, total
from infra_agent.trace.model import Span

GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# Below this share of the steps' time busy, the stream's GPU mostly waited on the host.
LAUNCH_BOUND_BUSY_MAX = 0.5


@dataclass
class StreamReport:
    stream: str  # the track's name, e.g. "stream 7"
    kernels: int  # device events (kernels, copies, sets)
    busy_us: float  # merged device time within the reference interval
    reference_us: float  # the steps' time (or the window's)
    reference: str  # "engine.step" or "window"
    median_kernel_us: float

    @property
    def busy_share(self) -> float:
        return self.busy_us / self.reference_us if self.reference_us > 0 else 0.0

    def to_dict(self) -> dict[str, object]:
        return {"stream": self.stream, "kernels": self.kernels, "busy_us": self.busy_us,
                "reference_us": self.reference_us, "reference": self.reference, "busy_share": self.busy_share,
                "median_kernel_us": self.median_kernel_us}


def stream_reports(gpu: list[Span], host: list[Span], window: Interval, step_span: str = "engine.step") -> list[StreamReport]:
    """One report per GPU stream in ``gpu`` (Kineto device events), busiest first, against
    the union of the ``step_span`` spans in ``host`` (our spans), else ``window``."""
    steps = merge((s.start_us, s.end_us) for s in host if s.name == step_span)
    reference, label = (steps, step_span) if steps else ([window], "window")
    ref_us = total(reference)
    by_stream: dict[str, list[Span]] = {}
    for s in gpu:
        by_stream.setdefault(s.thread, []).append(s)
    out = []
    for stream, spans in by_stream.items():
        busy = total(intersect(merge((s.start_us, s.end_us) for s in spans), clip(reference, window)))
        out.append(StreamReport(stream.strip(), len(spans), busy, ref_us, label,
                                statistics.median(s.end_us - s.start_us for s in spans)))
    return sorted(out, key=lambda r: -r.busy_us)
