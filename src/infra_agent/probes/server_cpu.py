"""Is the server starved of CPU?  Its threads' time on a CPU against their time waiting for one.

Linux keeps, per thread, the nanoseconds it ran and the nanoseconds it sat runnable in
a run queue (``/proc/<pid>/task/<tid>/schedstat``: run, wait, timeslices).  Over a window,
``run / seconds`` is the CPU a process got (in cores) and ``(run + wait) / seconds`` the
CPU its threads asked for; ``wait / (run + wait)`` is the share of its demand it did not
get.  An API server that streams tokens late because it could not run (pinned to a
busy core, a CPU hog beside it, more threads than cores) looks from outside exactly like
a network that holds packets back, so this is measured before any network explanation
is offered (``serving_telemetry.py`` puts the finding first).

Processes: the target's (a launched server and its descendants; a URL on loopback: the
processes listening on its port).  The one listening on the port is marked as the API
server: in vLLM that is the front end, its engine core a child process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from infra_agent.probes.target_processes import descendants
from infra_agent.target.host_load import listener_pids, target_processes

_PROC = Path("/proc")


def _threads(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (run ns, wait ns) of every thread of ``pid``; {} when gone or unreadable."""
    out: dict[int, tuple[int, int]] = {}
    try:
        tids = [int(t.name) for t in (_PROC / str(pid) / "task").iterdir()]
    except OSError:
        return out
    for tid in tids:
        try:
            run, wait, _slices = (_PROC / str(pid) / "task" / str(tid) / "schedstat").read_text().split()[:3]
        except (OSError, ValueError):
            continue
        out[tid] = (int(run), int(wait))
    return out


def _name(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def _cpus(pid: int) -> int | None:
    try:
        return len(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        return None


class ServerCpuWatch:
    """Snapshots the target's threads' schedstat at ``start`` and ``stop``."""

    def __init__(self, target: Any) -> None:
        pids, _groups = target_processes(target)
        self.pids = sorted({p for pid in pids for p in (pid, *descendants(pid))})
        try:
            port = urlsplit(target.url).port
        except (ValueError, AttributeError):
            port = None
        self.api = set(listener_pids(port)) if port else set()
        self._t0 = 0.0
        self._before: dict[int, dict[int, tuple[int, int]]] = {}

    @property
    def available(self) -> bool:
        return bool(self.pids) and (_PROC / "self" / "schedstat").is_file()

    def start(self) -> ServerCpuWatch:
        self._t0 = time.monotonic()
        self._before = {p: _threads(p) for p in self.pids}
        return self

    def stop(self) -> dict[str, Any]:
        """Per process: cores used, cores demanded, the share of demand spent waiting."""
        seconds = time.monotonic() - self._t0
        if not self.available:
            return {"source": None, "note": "no /proc schedstat, or no process of the target found on this machine"}
        procs = []
        for pid in self.pids:
            before, after = self._before.get(pid, {}), _threads(pid)
            run = wait = 0
            for tid, (r1, w1) in after.items():
                r0, w0 = before.get(tid, (0, 0))
                dr, dw = max(r1 - r0, 0), max(w1 - w0, 0)
                run, wait = run + dr, wait + dw
            if not after:
                continue
            demand = (run + wait) / 1e9 / seconds if seconds > 0 else 0.0
            procs.append({"pid": pid, "name": _name(pid), "api_server": pid in self.api, "threads": len(after),
                          "cpus_allowed": _cpus(pid), "cores_used": run / 1e9 / seconds if seconds > 0 else 0.0,
                          "cores_demanded": demand, "wait_share": wait / (run + wait) if run + wait else 0.0,
                          "run_s": run / 1e9, "wait_s": wait / 1e9})
        return {"source": "proc schedstat", "seconds": seconds, "processes": procs}
