"""A step loop that waits on a KV transfer: the prefill side of a disaggregated server whose
steps do not end until their requests' KV is out.

A KV connector that saves synchronously (vLLM's ``wait_for_save`` at the end of the
forward; refstack's prefill worker with ``kv_transfer`` off) spends part of every step
moving KV: packing it, then waiting for the link.  Those parts are spans of category
``kv`` on the step's own thread, inside its ``engine.step`` spans (refstack: ``kv.put_bulk``,
``kv.wait``).  This module measures them per step thread; the finding ``transfer_wait``
(``feedback``) names the transfer when they are a large share of the steps, and says
whether the transfer already goes layer by layer (its spans carry a ``layer`` arg).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from infra_agent.trace.intervals import Interval, intersect, merge, total
from infra_agent.trace.model import Span

TRANSFER_CAT = "kv"
TRANSFER_WAIT_SHARE_MIN = 0.15  # of the step thread's step time


@dataclass
class TransferWait:
    thread: str
    steps: int
    step_us: float  # the thread's steps, merged
    transfer_us: float  # of which inside its own transfer spans
    by_name: dict[str, float] = field(default_factory=dict)  # span name -> µs inside steps
    layered: bool = False  # some transfer span of the window names a layer: the transfer is layer-wise
    requests: int = 0  # distinct request ids on the thread's transfer spans

    @property
    def share(self) -> float:
        return self.transfer_us / self.step_us if self.step_us else 0.0

    @property
    def top(self) -> str:
        return max(self.by_name, key=self.by_name.__getitem__) if self.by_name else TRANSFER_CAT

    def to_dict(self) -> dict[str, object]:
        return {"thread": self.thread, "steps": self.steps, "step_us": self.step_us, "transfer_us": self.transfer_us,
                "share": self.share, "by_name": self.by_name, "layered": self.layered, "requests": self.requests,
                "span": self.top}


def transfer_waits(spans: list[Span], step_span: str = "engine.step") -> list[TransferWait]:
    """Per thread that runs ``step_span``: how much of its steps its ``kv`` spans took, largest share first."""
    steps: dict[str, list[Interval]] = defaultdict(list)
    moves: dict[str, list[Span]] = defaultdict(list)
    layered = False
    for s in spans:
        if s.name == step_span:
            steps[s.thread].append((s.start_us, s.end_us))
        elif s.cat == TRANSFER_CAT:
            moves[s.thread].append(s)
            layered = layered or (isinstance(s.args.get("layer"), int) and s.args["layer"] >= 0)
    out = []
    for thread, ivs in steps.items():
        if not moves.get(thread):
            continue
        step_m = merge(ivs)
        names: dict[str, list[Interval]] = defaultdict(list)
        for s in moves[thread]:
            names[s.name].append((s.start_us, s.end_us))
        inside = intersect(merge(iv for v in names.values() for iv in v), step_m)
        by_name = {n: total(intersect(merge(v), step_m)) for n, v in names.items()}
        rids = {s.args.get("request_id") for s in moves[thread] if s.args.get("request_id")}
        out.append(TransferWait(thread, len(ivs), total(step_m), total(inside),
                                {k: v for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0},
                                layered, len(rids)))
    return sorted(out, key=lambda w: -w.share)
