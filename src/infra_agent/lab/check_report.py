"""The results of a correctness check: ``CheckResult`` is one comparison, ``CheckReport``
a spec's whole check.

Plain data, apart from the code that runs checks (:mod:`infra_agent.lab.correctness`);
a check worker sends its ``CheckResult`` lists back to the parent pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from infra_agent.lab.numerics import Condition, ErrorStats

Status = Literal["passed", "failed", "skipped"]
# Why a call gave no output to judge: it raised, ran past its timeout, or took its
# worker process down with it.
Fault = Literal["raised", "timeout", "crashed"]


@dataclass
class CheckResult:
    """One comparison: ``variant`` against ``against`` ("reference" or "kernel")."""

    variant: str
    against: str
    precision: str
    shape: str
    dtype: str
    seed: int | None
    output: str
    status: Status
    tolerance: str = ""
    stats: ErrorStats | None = None
    message: str = ""
    condition: Condition | None = None
    fault: Fault | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stats"] = self.stats.to_dict() if self.stats else None
        d["condition"] = self.condition.label() if self.condition else None
        return d


@dataclass
class CheckReport:
    spec: str
    origin: str
    device: str
    seeds: list[int]
    results: list[CheckResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # Seconds each call had in a worker process; None: the calls ran in this process.
    timeout_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(r.status == "failed" for r in self.results)

    @property
    def checked(self) -> int:
        """Comparisons that ran; 0 means every case was skipped and nothing was judged."""
        return sum(1 for r in self.results if r.status != "skipped")

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    def rows(self) -> list[CheckResult]:
        """One row per (variant, against, precision, output): the worst over seeds, shapes, dtypes."""
        groups: dict[tuple[str, str, str, str], CheckResult] = {}
        for r in self.results:
            if r.status == "skipped":
                continue
            key = (r.variant, r.against, r.precision, r.output)
            best = groups.get(key)
            if best is None or _badness(r) > _badness(best):
                groups[key] = r
        return list(groups.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "origin": self.origin,
            "device": self.device,
            "seeds": self.seeds,
            "passed": self.passed,
            "checked": self.checked,
            "skipped": self.skipped,
            "timeout_s": self.timeout_s,
            "notes": self.notes,
            "results": [r.to_dict() for r in self.results],
        }


def _badness(r: CheckResult) -> tuple[int, float]:
    # Failures first, then the largest relative Frobenius error.
    return (1 if r.status == "failed" else 0, r.stats.rel_fro if r.stats else float("inf"))
