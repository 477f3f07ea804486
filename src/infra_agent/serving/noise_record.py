"""The process-noise calibration of one workspace on one machine, kept beside its ledger.

``infra-agent calibrate`` measures how much two fresh, identically configured server
processes differ (serving/calibrate_noise.py) and writes it to
``<workspace>/.infra-agent/process-noise.json``; the loop reads it so that its
interval carries that spread (judge/process_noise.py).  The figure belongs to a
machine: it records the host name and the CPUs the process may use, and a loop on
another machine ignores it, saying so.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from infra_agent.errors import ConfigError
from infra_agent.workspace.machine import machine_limits

CALIBRATION_FILE = Path(".infra-agent") / "process-noise.json"


class Machine(BaseModel):
    hostname: str
    usable_cpus: int

    @classmethod
    def here(cls) -> Machine:
        # The cores this process may run on (its affinity), as the search space bounds threads.
        return cls(hostname=socket.gethostname(), usable_cpus=machine_limits(None).cores)


class MetricNoise(BaseModel):
    """One metric's spread between processes (stats/process_noise.py ``ProcessSpread``)."""

    tau: float = Field(ge=0)  # sd of the log ratio between two fresh processes
    within_sd: float = Field(ge=0)  # sd of one window's log ratio inside one process pair
    f: float | None = None  # between/within mean squares; None when undefined
    df: tuple[int, int]
    p: float | None = None
    blocks: int
    pairs: int


class NoiseCalibration(BaseModel):
    scenario: str
    machine: Machine
    blocks: int
    pairs_per_block: int
    measured_at: float = Field(default_factory=time.time)
    wall_s: float = 0.0
    load_before: float | None = None  # 1-minute load average when it started and ended
    load_after: float | None = None
    metrics: dict[str, MetricNoise]

    def taus(self) -> dict[str, float]:
        return {name: m.tau for name, m in self.metrics.items()}


def calibration_path(root: Path) -> Path:
    return Path(root) / CALIBRATION_FILE


def save(root: Path, cal: NoiseCalibration) -> Path:
    """Write atomically (a killed write leaves the previous file, never half of one)."""
    path = calibration_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".process-noise.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(cal.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def load(root: Path) -> NoiseCalibration | None:
    """The workspace's calibration, or None when it has none; a damaged file is a ConfigError naming it."""
    path = calibration_path(root)
    if not path.exists():
        return None
    try:
        data: Any = json.loads(path.read_text())
        return NoiseCalibration.model_validate(data)
    except (json.JSONDecodeError, ValidationError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(str(path), None, "a process-noise calibration written by `infra-agent calibrate` (run it "
                          "again, or delete the file)", first) from exc


__all__ = ["CALIBRATION_FILE", "Machine", "MetricNoise", "NoiseCalibration", "calibration_path", "load", "save"]
