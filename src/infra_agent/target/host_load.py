"""What else the machine did while a serving window ran, so a window under foreign load shows.

A window measured while another process eats a core measures the machine, not the
configuration.  ``HostSampler`` is started just before a window and stopped just after
it; ``stop()`` returns a ``HostLoad``:

- ``loadavg_start`` / ``loadavg_end``: the 1-minute load average (``os.getloadavg``).  It
  counts every runnable task, ours included, and trails by a minute: context, not a
  verdict.
- ``foreign_cpu``: CPU used by processes *outside the experiment* during the window, in
  cores (busy CPU-seconds / window seconds).  From ``/proc``: the busy jiffies (user,
  nice, system, irq, softirq, steal) of the CPUs the experiment may run on, from the
  per-CPU lines of ``/proc/stat``, minus the jiffies of the experiment's own processes.
- ``cores``: how many CPUs that count covers: this process's affinity, together with
  the affinity of the own processes named (a server pinned to another core).

The experiment's own processes are this process (``/proc/<pid>/stat`` sums its
threads), the pids and process groups given (the target's group: the server the window
talks to), and every group a server this process launched leads: a child of ours whose
environment carries ``INFRA_AGENT_OWNER=<our pid>:...`` (``procgroup``'s mark), which
covers the other side of an interleaved A/B.  Each counts utime + stime + cutime +
cstime, so a child it reaped during the window stays its own.  ``target_processes``
names a running target's (a launched server's group; for a URL on loopback, the
processes listening on its port, ``listener_pids``).

Without ``/proc`` (macOS), or when it cannot be read, only the load average is
recorded (``source`` "loadavg-only", ``foreign_cpu`` None, ``note`` says why).  Sampling
never raises: a window is never lost to its bookkeeping.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from infra_agent.target.procgroup import _environ_owner

_PROC = Path("/proc")


@dataclass(frozen=True)
class HostLoad:
    """The machine's load over one window (see the module docstring)."""

    seconds: float
    loadavg_start: float | None
    loadavg_end: float | None
    foreign_cpu: float | None
    own_cpu: float | None
    cores: int
    source: Literal["proc", "loadavg-only"]
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "loadavg_start": _round(self.loadavg_start), "loadavg_end": _round(self.loadavg_end),
            "foreign_cpu": _round(self.foreign_cpu), "own_cpu": _round(self.own_cpu), "cores": self.cores,
            "seconds": _round(self.seconds), "source": self.source,
        }
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class _Proc:
    ppid: int
    pgrp: int
    ticks: int  # utime + stime + cutime + cstime


@dataclass(frozen=True)
class _Snapshot:
    at: float
    loadavg: float | None
    busy: int | None  # jiffies over the counted CPUs; None without /proc
    procs: dict[int, _Proc]
    own: frozenset[int]


class HostSampler:
    """``start()`` before a window, ``stop()`` after it; one sampler per window."""

    def __init__(self, own_pids: Iterable[int] = (), own_pgids: Iterable[int] = (), *, proc: Path = _PROC) -> None:
        self.own_pids = frozenset([os.getpid(), *own_pids])
        self.own_pgids = frozenset(own_pgids)
        self.proc = proc
        self._cpus: list[int] = []
        self._start: _Snapshot | None = None
        self._note: str | None = None

    def start(self) -> None:
        self._note = None
        procs = self._processes()
        own = self._own(procs) if procs is not None else frozenset()
        self._cpus = _cpus_of(own)
        self._start = self._snapshot(procs, own)

    def stop(self) -> HostLoad:
        assert self._start is not None, "HostSampler.stop() before start()"
        start, self._start = self._start, None
        procs = self._processes() if start.busy is not None else None
        end = self._snapshot(procs, self._own(procs) if procs is not None else frozenset())
        seconds = max(end.at - start.at, 1e-9)
        if start.busy is None or end.busy is None:
            return HostLoad(seconds, start.loadavg, end.loadavg, None, None, len(self._cpus), "loadavg-only",
                            self._note or "no readable /proc: load average only")
        hz = os.sysconf("SC_CLK_TCK")
        own = _own_ticks(start, end) / hz / seconds
        foreign = max(0.0, (end.busy - start.busy) / hz / seconds - own)
        return HostLoad(seconds, start.loadavg, end.loadavg, foreign, max(0.0, own), len(self._cpus), "proc")

    # ------------------------------------------------------------ reading

    def _snapshot(self, procs: dict[int, _Proc] | None, own: frozenset[int]) -> _Snapshot:
        busy = self._busy() if procs is not None else None
        return _Snapshot(time.monotonic(), loadavg(), busy, procs or {}, own)

    def _processes(self) -> dict[int, _Proc] | None:
        """Every process's parent, group and CPU ticks; None when ``/proc`` cannot be read."""
        try:
            entries = [e for e in self.proc.iterdir() if e.name.isdigit()]
        except OSError as exc:
            self._note = f"no readable {self.proc} ({exc.strerror or type(exc).__name__}): load average only"
            return None
        out: dict[int, _Proc] = {}
        for entry in entries:
            try:
                stat = (entry / "stat").read_text()
                # comm (field 2) may hold spaces and parens: split after the last ')'.
                f = stat[stat.rfind(")") + 2 :].split()
                out[int(entry.name)] = _Proc(int(f[1]), int(f[2]), int(f[11]) + int(f[12]) + int(f[13]) + int(f[14]))
            except (OSError, ValueError, IndexError):
                continue  # exited while we looked
        return out

    def _own(self, procs: dict[int, _Proc]) -> frozenset[int]:
        me = os.getpid()
        mark = f"{me}:"
        groups = set(self.own_pgids)
        for pid, p in procs.items():
            # A server we launched leads its own session (pgid == pid) and carries our mark.
            if p.ppid == me and p.pgrp == pid and (_environ_owner(pid) or "").startswith(mark):
                groups.add(pid)
        return frozenset(pid for pid, p in procs.items() if pid in self.own_pids or p.pgrp in groups)

    def _busy(self) -> int | None:
        try:
            lines = (self.proc / "stat").read_text().splitlines()
        except OSError as exc:
            self._note = f"cannot read {self.proc / 'stat'} ({exc.strerror}): load average only"
            return None
        wanted, total, seen = {f"cpu{c}" for c in self._cpus}, 0, 0
        for line in lines:
            parts = line.split()
            if parts and parts[0] in wanted:
                # user nice system idle iowait irq softirq steal (guest is inside user)
                try:
                    v = [int(x) for x in parts[1:9]]
                except ValueError:
                    continue
                v += [0] * (8 - len(v))
                total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                seen += 1
        if not seen:
            self._note = f"no per-CPU lines for CPUs {self._cpus} in {self.proc / 'stat'}: load average only"
            return None
        return total


MAX_FOREIGN_CPU_ENV = "INFRA_AGENT_MAX_FOREIGN_CPU"
DEFAULT_MAX_FOREIGN_CPU = 0.5  # cores: another process took half a core on average


def parse_max_foreign_cpu(text: str | float | None) -> float | None:
    """``off`` (never re-run a window for load) or a number of cores; ValueError otherwise."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    if text.strip().lower() in ("off", "none", "no"):
        return None
    value = float(text)
    if not value >= 0:
        raise ValueError(f"expected a number of cores >= 0 or 'off', got {text!r}")
    return value


def default_max_foreign_cpu() -> float | None:
    """The re-run threshold when none is given: ``INFRA_AGENT_MAX_FOREIGN_CPU`` (``off`` or cores), else 0.5.

    A test suite that runs servers side by side on purpose sets it ``off``: there every
    window shares the machine with the other workers' servers by design."""
    raw = os.environ.get(MAX_FOREIGN_CPU_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_MAX_FOREIGN_CPU
    try:
        return parse_max_foreign_cpu(raw)
    except ValueError:
        return DEFAULT_MAX_FOREIGN_CPU


def listener_pids(port: int, *, proc: Path = _PROC) -> list[int]:
    """PIDs of this machine's processes holding a socket that listens on TCP ``port``.

    How a server reached by URL (an endpoint someone else started on this machine) is
    counted as the experiment's own: its sockets' inodes from ``/proc/net/tcp{,6}``,
    matched against ``/proc/<pid>/fd``.  Only processes whose descriptors we may read
    (our user's) are found; [] without ``/proc``."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            # local_address is ADDR:PORT in hex; state 0A is LISTEN.
            if len(f) > 9 and f[3] == "0A" and f[1].rsplit(":", 1)[-1] == f"{port:04X}":
                inodes.add(f"socket:[{f[9]}]")
    if not inodes:
        return []
    found: list[int] = []
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:
            continue  # not ours to read, or gone
    return sorted(found)


def target_processes(target: Any) -> tuple[list[int], list[int]]:
    """A running target's processes and process groups (``own_pids``, ``own_pgids`` of a
    ``HostSampler``): the server a window talks to is the experiment's own load.

    A launched server leads its own group (``ServerProcess.pgid``).  A URL or an endpoint
    has no process of ours (``pid`` None): on loopback, the processes listening on its
    port are the server all the same, so their groups count as own, not as foreign."""
    pid, pgid = getattr(target, "pid", None), getattr(target, "pgid", None)
    if isinstance(pid, int):
        return [pid], ([pgid] if isinstance(pgid, int) else [pid])
    try:
        parts = urlsplit(target.url)
        port = parts.port
    except ValueError:
        return [], []
    if parts.hostname not in ("127.0.0.1", "localhost", "::1") or port is None:
        return [], []
    pids = listener_pids(port)
    groups: set[int] = set()
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except OSError:
            continue
    return pids, sorted(groups)


def _own_ticks(start: _Snapshot, end: _Snapshot) -> int:
    """CPU ticks the own processes used between the snapshots.

    A process that exited during the window left its time in its parent's cutime when an
    own parent reaped it; otherwise that time is lost, and counted foreign (an
    overestimate, never a negative)."""
    total = 0
    for pid in start.own | end.own:
        before = start.procs.get(pid)
        after = end.procs.get(pid)
        if after is None:
            if before is not None and before.ppid in end.own:
                total -= before.ticks  # its whole life is in the parent's cutime now
            continue
        total += after.ticks - (before.ticks if before is not None else 0)
    return total


def _cpus_of(pids: Iterable[int]) -> list[int]:
    """CPUs this process, or any own process, may run on."""
    if not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    cpus = set(os.sched_getaffinity(0))
    for pid in pids:
        try:
            cpus |= os.sched_getaffinity(pid)
        except OSError:
            continue
    return sorted(cpus)


def loadavg() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def host_summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Several windows' ``HostLoad.as_dict()`` (each with its ``scenario`` and ``index``) as one
    record: the load average at the first start and the last end, the largest
    ``foreign_cpu`` (the worst window decides whether the run was disturbed), the cores,
    ``source`` "proc" only when every window was counted from ``/proc``, the seconds
    summed, and ``windows``, the list itself."""
    assert windows, "host_summary of no window"
    foreign = [float(w["foreign_cpu"]) for w in windows if isinstance(w.get("foreign_cpu"), (int, float))]
    out: dict[str, Any] = {
        "loadavg_start": windows[0].get("loadavg_start"), "loadavg_end": windows[-1].get("loadavg_end"),
        "foreign_cpu": max(foreign) if foreign else None, "cores": max(int(w.get("cores") or 0) for w in windows),
        "source": "proc" if all(w.get("source") == "proc" for w in windows) else "loadavg-only",
        "seconds": _round(sum(float(w.get("seconds") or 0.0) for w in windows)), "windows": windows,
    }
    notes = sorted({str(w["note"]) for w in windows if w.get("note")})
    if notes:
        out["note"] = "; ".join(notes)
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


__all__ = ["HostLoad", "HostSampler", "host_summary", "listener_pids", "target_processes"]
