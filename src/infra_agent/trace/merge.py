"""One Chrome-trace file of everything loaded, on the timeline clock (Perfetto opens it).

Tracks: our spans keep their process and thread names; Kineto events go under a
process of their own (their pids and tids are another tool's numbers); the py-spy
samples become a "GIL holder" track of complete events, one per holder segment,
named ``thread: function (file:line)``, so a wait on one thread lines up visually with
the frame that held the GIL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from infra_agent.trace.gil import holder_timeline
from infra_agent.trace.model import SOURCE_KINETO, Timeline

GIL_PID = 1_000_000_001  # synthetic process ids that no real pid collides with in practice
KINETO_PID = 1_000_000_002


def merged_events(timeline: Timeline) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    named: set[tuple[int, int]] = set()

    def name_thread(pid: int, tid: int, thread: str) -> None:
        if (pid, tid) not in named:
            named.add((pid, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})

    events.append({"ph": "M", "name": "process_name", "pid": KINETO_PID, "tid": 0, "args": {"name": "kineto (profiler)"}})
    events.append({"ph": "M", "name": "process_name", "pid": GIL_PID, "tid": 0, "args": {"name": "GIL (py-spy --gil)"}})
    for s in timeline.spans:
        pid = KINETO_PID if s.source == SOURCE_KINETO else s.pid
        name_thread(pid, s.tid, s.thread)
        ev = {"ph": "X", "name": s.name, "cat": s.cat, "pid": pid, "tid": s.tid, "ts": s.start_us, "dur": s.dur_us}
        if s.args:
            ev["args"] = s.args
        events.append(ev)
    for i in timeline.instants:
        name_thread(i.pid, i.tid, i.thread)
        events.append({"ph": "i", "s": "t", "name": i.name, "cat": i.cat, "pid": i.pid, "tid": i.tid, "ts": i.ts_us,
                       **({"args": i.args} if i.args else {})})
    if timeline.samples and timeline.sampled_window:
        name_thread(GIL_PID, 1, "GIL holder")
        for seg in holder_timeline(timeline.samples, timeline.sampled_window):
            events.append({"ph": "X", "name": f"{seg.thread}: {seg.function} ({seg.where})", "cat": "gil",
                           "pid": GIL_PID, "tid": 1, "ts": seg.start_us, "dur": seg.end_us - seg.start_us,
                           "args": {"thread": seg.thread, "where": seg.where}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "infra_agent.trace.merge", "clock_origin_unix_ns": timeline.origin_unix_ns,
                          "sources": timeline.sources}}


def write_merged(timeline: Timeline, path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(merged_events(timeline), default=str))
    os.replace(tmp, target)
    return target
