"""Synthetic traces with known overlaps and GIL holders (times in µs)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ORIGIN_NS = 1_700_000_000_000_000_000
MAIN, KV = 101, 102  # native tids
MAIN_IDENT, KV_IDENT = 140000000000001, 140000000000002  # pthread idents (py-spy's tids)


def ours(spans: list[tuple[str, str, int, float, float, dict[str, Any] | None]], origin_ns: int = ORIGIN_NS,
         instants: list[tuple[str, int, float, dict[str, Any]]] = ()) -> dict[str, Any]:
    """spans: (name, cat, tid, start_us, end_us, args)."""
    names = {MAIN: ("MainThread", MAIN_IDENT), KV: ("kv-transfer", KV_IDENT)}
    events: list[dict[str, Any]] = [{"ph": "M", "pid": 7, "tid": 0, "name": "process_name", "args": {"name": "pid 7"}}]
    for tid, (name, ident) in names.items():
        events.append({"ph": "M", "pid": 7, "tid": tid, "name": "thread_name", "args": {"name": name, "ident": ident}})
    for name, cat, tid, s, e, args in spans:
        ev = {"ph": "X", "name": name, "cat": cat, "pid": 7, "tid": tid, "ts": s, "dur": e - s}
        if args:
            ev["args"] = args
        events.append(ev)
    for name, tid, ts, args in instants:
        events.append({"ph": "i", "s": "t", "name": name, "cat": "server", "pid": 7, "tid": tid, "ts": ts, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "infra_agent.tracing", "clock_origin_unix_ns": origin_ns, "dropped_events": 0}}


def case_b_spans() -> dict[str, Any]:
    # MainThread: ep.dispatch [1000,3000], ep.combine [5000,7000] inside engine.step [0,8000]
    # kv-transfer: one transfer span over the whole window [0,8000]
    return ours([
        ("engine.step", "engine", MAIN, 0, 8000, None),
        ("ep.dispatch", "ep", MAIN, 1000, 3000, {"tokens": 4}),
        ("ep.combine", "ep", MAIN, 5000, 7000, {"tokens": 4}),
        ("transfer", "kv_transfer", KV, 0, 8000, None),
    ])


def case_b_pyspy() -> list[dict[str, Any]]:
    """py-spy 0.4 style (tid = pthread ident, no names), ts on py-spy's clock (zero = ORIGIN_NS + 0)."""
    def ev(ph: str, tid: int, ts: int, name: str, file: str, line: int) -> dict[str, Any]:
        return {"args": {"filename": file, "line": line}, "cat": "py-spy", "name": name, "ph": ph, "pid": 7,
                "tid": tid, "ts": ts}
    return [
        ev("B", KV_IDENT, 0, "run", "kv.py", 5), ev("B", KV_IDENT, 0, "send", "kv.py", 10),
        ev("B", MAIN_IDENT, 1000, "step", "engine.py", 20), ev("B", MAIN_IDENT, 1000, "dispatch", "moe.py", 42),
        ev("E", KV_IDENT, 3000, "send", "kv.py", 10), ev("B", KV_IDENT, 3000, "send", "kv.py", 11),
        ev("E", MAIN_IDENT, 5000, "dispatch", "moe.py", 42), ev("B", MAIN_IDENT, 5000, "combine", "moe.py", 77),
        ev("E", KV_IDENT, 7000, "send", "kv.py", 11), ev("B", KV_IDENT, 7000, "send", "kv.py", 12),
        # closing events at write time
        ev("E", KV_IDENT, 8000, "send", "kv.py", 12), ev("E", KV_IDENT, 8000, "run", "kv.py", 5),
        ev("E", MAIN_IDENT, 8000, "combine", "moe.py", 77), ev("E", MAIN_IDENT, 8000, "step", "engine.py", 20),
    ]


def write(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc))
    return path


def set_mtime_ns(path: Path, ns: int) -> None:
    os.utime(path, ns=(ns, ns))
