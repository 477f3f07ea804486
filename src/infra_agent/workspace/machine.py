"""What the machine gives the target: cores and memory, and the knob values they bound.

A knob that declares ``resource: threads`` (``per_process: N`` when N processes of the
launch each take that many threads) is never searched, nor run, above the cores the
target may use; ``resource: memory_gib`` / ``memory_mib`` never above the memory the
machine has.  A search on a 2-core box once launched ``--torch-threads 448``: 1,627
threads per process, a load average of 253, and every measurement of the run spoilt.

The cores are those this process may run on (``os.sched_getaffinity``: a container or
``taskset`` gives fewer than the host has), the memory ``/proc/meminfo``'s MemTotal; a
workspace overrides either with ``machine: {cores: 8, memory_gib: 64}`` (a target that
runs elsewhere, or a share of a bigger host).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from infra_agent.workspace._base import _Strict
from infra_agent.workspace.knobs import Knob

_MEMINFO = Path("/proc/meminfo")
# What one knob unit is worth in GiB, per resource kind.
_GIB_PER_UNIT = {"memory_gib": 1.0, "memory_mib": 1.0 / 1024}


class Machine(_Strict):
    """``machine:`` in ``infra-agent.yaml``: what the target may use, when not this machine's."""

    cores: int | None = Field(None, gt=0)
    memory_gib: float | None = Field(None, gt=0)


@dataclass(frozen=True)
class MachineLimits:
    """The cores and memory the target may use, each with where the number comes from."""

    cores: int
    cores_from: str
    memory_gib: float | None
    memory_from: str

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "cores_from": self.cores_from,
                "memory_gib": None if self.memory_gib is None else round(self.memory_gib, 2), "memory_from": self.memory_from}


def _cores() -> tuple[int, str]:
    try:
        return len(os.sched_getaffinity(0)), "os.sched_getaffinity(0): the cores this process may run on"
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1, "os.cpu_count()"


def _memory_gib() -> tuple[float | None, str]:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024), "/proc/meminfo MemTotal"
    except (OSError, ValueError, IndexError):
        pass
    return None, "unknown (no /proc/meminfo)"


def machine_limits(override: Machine | None) -> MachineLimits:
    """This machine's cores and memory, with ``override``'s values (``machine:``) in their place."""
    if override is not None and override.cores is not None:
        cores, cores_from = override.cores, "machine.cores in infra-agent.yaml"
    else:
        cores, cores_from = _cores()
    memory: float | None
    if override is not None and override.memory_gib is not None:
        memory, memory_from = override.memory_gib, "machine.memory_gib in infra-agent.yaml"
    else:
        memory, memory_from = _memory_gib()
    return MachineLimits(cores, cores_from, memory, memory_from)


@dataclass(frozen=True)
class Bound:
    """The largest value of one knob the machine allows, and why."""

    knob: str
    limit: float  # the knob's own largest value (the machine's total over its processes)
    total: float  # the machine's total, in the knob's unit
    unit: str  # "cores", "GiB" or "MiB"
    source: str

    def describe(self) -> str:
        return f"<= {_num(self.limit)} ({_num(self.total)} {self.unit}{self._per()}; {self.source})"

    def _per(self) -> str:
        return "" if self.total == self.limit else f" / {_num(self.total / self.limit if self.limit else 0)} processes"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def _total(resource: str, limits: MachineLimits) -> tuple[float, str, str] | None:
    """The machine's amount of ``resource`` in the knob's unit, the unit's name, the source."""
    if resource == "threads":
        return float(limits.cores), "cores", limits.cores_from
    if limits.memory_gib is None:
        return None
    per_unit = _GIB_PER_UNIT[resource]
    return limits.memory_gib / per_unit, "GiB" if resource == "memory_gib" else "MiB", limits.memory_from


def knob_bound(name: str, knob: Knob, limits: MachineLimits) -> Bound | None:
    """The largest value ``knob`` may take on this machine (None when it consumes nothing)."""
    if knob.resource is None:
        return None
    total = _total(knob.resource, limits)
    if total is None:
        return None
    amount, unit, source = total
    limit = amount / knob.processes
    if knob.type == "int" or knob.resource == "threads":
        limit = math.floor(limit)
    return Bound(name, limit, amount, unit, source)


@dataclass(frozen=True)
class Oversubscription:
    """A configuration that asks for more of a resource than the machine has."""

    resource: str  # "threads" or "memory"
    parts: tuple[tuple[str, float, int, str], ...]  # (knob, value, processes, the value's unit)
    total: float
    unit: str
    source: str

    def message(self) -> str:
        asked = " + ".join(f"{k}={_num(v)}{'' if u == 'threads' else ' ' + u} x {n} process{'es' if n != 1 else ''}"
                           for k, v, n, u in self.parts)
        verb = "oversubscribes the machine" if self.resource == "threads" else "asks for more memory than the machine has"
        return f"{verb}: {asked} > {_num(self.total)} {self.unit} ({self.source})"


def oversubscriptions(knobs: Mapping[str, Knob], values: Mapping[str, Any], limits: MachineLimits,
                      only: set[str] | None = None) -> list[Oversubscription]:
    """Resources that ``values`` ask more of than the machine has: the sum, over the knobs that
    consume it, of value x processes (threads against cores; GiB and MiB together against the
    memory).  ``only``: report a resource only when one of its knobs is in it (a step that leaves
    an oversubscribed default alone is not the step to blame)."""
    out: list[Oversubscription] = []
    for group, kinds in (("threads", ("threads",)), ("memory", ("memory_gib", "memory_mib"))):
        parts: list[tuple[str, float, int, str]] = []
        asked = 0.0
        for name, knob in knobs.items():
            value = values.get(name)
            if knob.resource not in kinds or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            unit = "threads" if group == "threads" else ("GiB" if knob.resource == "memory_gib" else "MiB")
            parts.append((name, float(value), knob.processes, unit))
            asked += float(value) * knob.processes * (1.0 if group == "threads" else _GIB_PER_UNIT[knob.resource or ""])
        total = _total(kinds[0], limits)
        if not parts or total is None or (only is not None and not {p[0] for p in parts} & only):
            continue
        amount, unit, source = total
        if asked > amount * (1 + 1e-9):
            out.append(Oversubscription(group, tuple(parts), amount, unit, source))
    return out


__all__ = ["Bound", "Machine", "MachineLimits", "Oversubscription", "knob_bound", "machine_limits", "oversubscriptions"]
