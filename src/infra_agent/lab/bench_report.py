"""What a ``bench`` run found: its entries (one per kernel, precision and input) and the report.

Data only, as :mod:`infra_agent.lab.check_report` is for checks; :mod:`infra_agent.lab.microbench`
runs the bench that fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from infra_agent.lab.check_report import CheckReport
from infra_agent.lab.roofline import Ceilings, RooflinePoint
from infra_agent.lab.timing import Timing

EntryStatus = Literal["timed", "refused", "failed", "skipped"]


def input_key(shape: str, dtype: str) -> str:
    """``"<shape label>;dtype=<dtype without 'torch.'>"``: one bench input (shape and dtype)."""
    return f"{shape};dtype={dtype}"


@dataclass
class BenchEntry:
    variant: str
    precision: str
    shape: str
    dtype: str
    status: EntryStatus
    message: str = ""
    timing: Timing | None = None
    flops: float | None = None
    bytes: float | None = None
    roofline: RooflinePoint | None = None

    @property
    def input_key(self) -> str:
        """The bench input this entry ran on, as ``BenchReport.copies`` keys it."""
        return input_key(self.shape, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "precision": self.precision,
            "shape": self.shape,
            "dtype": self.dtype,
            "status": self.status,
            "message": self.message,
            "timing": self.timing.to_dict() if self.timing else None,
            "flops": self.flops,
            "bytes": self.bytes,
            "roofline": self.roofline.to_dict() if self.roofline else None,
        }


@dataclass
class BenchReport:
    spec: str
    origin: str
    device: str
    checks: list[CheckReport]
    ceilings: Ceilings | None = None
    entries: list[BenchEntry] = field(default_factory=list)
    # variant -> {"shape": ..., **WorkCounter.to_dict()}
    work: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    # "<shape>;dtype=<dtype>" -> a plain copy of that input's declared bytes, timed like its entries
    # (``roofline.time_copy_of``): the size's floor, beside which a memory-bound entry's headroom splits.
    copies: dict[str, Timing] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every correctness check passed (what ``passed_check`` reports)."""
        return all(c.passed for c in self.checks)

    @property
    def refused(self) -> list[BenchEntry]:
        return [e for e in self.entries if e.status == "refused"]

    @property
    def timing_failures(self) -> list[BenchEntry]:
        """Entries that passed their check but raised while being timed."""
        return [e for e in self.entries if e.status == "failed"]

    @property
    def ok(self) -> bool:
        # A kernel that raises under timing (e.g. an in-place state that blows up over
        # repeated calls) has no speed to report: the run failed, even though every
        # check passed.
        return self.passed and not self.timing_failures

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "origin": self.origin,
            "device": self.device,
            "passed_check": self.passed,
            "ok": self.ok,
            "checks": [c.to_dict() for c in self.checks],
            "ceilings": self.ceilings.to_dict() if self.ceilings else None,
            "entries": [e.to_dict() for e in self.entries],
            "work": self.work,
            "skipped": self.skipped,
            "copies_same_bytes": {k: t.to_dict() for k, t in self.copies.items()},
        }
