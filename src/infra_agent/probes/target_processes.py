"""Which process of a target to sample: the server, a named child, or the busiest one (Linux /proc).

A disaggregated server does its work in child processes, and the one worth sampling is
not always the busiest by CPU time (a worker blocked in a native call uses none), so
the timeline probe can name it by process name or measure CPU over a lead-in.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        parent[int(entry)] = int(rest[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _cpu_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2:].split()
    return int(rest[11]) + int(rest[12])  # utime + stime


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def pick_process(server: int, mode: str, lead_s: float, worker: threading.Thread) -> tuple[int, dict[str, Any]]:
    """The process to sample: the server, or the busiest of it and its descendants over ``lead_s``."""
    if mode == "server":
        worker.join(lead_s) if lead_s else None
        return server, {"pid": server, "why": "the server process"}
    pids = [server, *descendants(server)]
    if mode != "auto":
        worker.join(lead_s) if lead_s else None
        named = [p for p in pids if _comm(p) == mode] or [p for p in [server, *descendants(server)] if _comm(p) == mode]
        if named:
            return named[0], {"pid": named[0], "name": mode, "why": f"the process named {mode!r}"}
        return server, {"pid": server, "why": f"no process named {mode!r} among the server's "
                                              f"{len(pids)}: the server process"}
    before = {p: _cpu_ticks(p) for p in pids}
    worker.join(lead_s if lead_s > 0 else 0.2)
    used = {p: (t1 - t0) for p in pids if (t0 := before[p]) is not None and (t1 := _cpu_ticks(p)) is not None}
    if not used:
        return server, {"pid": server, "why": "the server process (no CPU times readable)"}
    best = max(used, key=lambda p: (used[p], p == server))
    name = ""
    try:
        name = Path(f"/proc/{best}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")[:200]
    except OSError:
        pass
    return best, {"pid": best, "cmdline": name, "cpu_ticks": used,
                  "why": f"busiest of {len(pids)} process(es) over the first {lead_s:g} s"}
