"""Feedback: what every probe returns, plain JSON-serialisable data.

- ``Measurement``: one metric with its raw samples, a summary, and locality tags that
  tie it to something the agent can act on (component, kernel, thread, interval,
  input condition, knob).
- ``Finding``: one observation with a location, the evidence numbers and the next
  question worth asking.
- ``Artifact``: a file the probe produced (trace JSON, server log, result JSON).

``Feedback.render_text()`` gives the compact form that goes into an LLM prompt.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

_CI_MAX_SAMPLES = 4000
LOCALITY_KEYS = ("component", "kernel", "thread", "interval", "input", "knob", "variant", "precision", "scenario")


class Tier(str, Enum):
    """Probe cost order: a cheaper tier answers first when its scope covers the question."""

    check = "check"
    micro = "micro"
    trace = "trace"
    e2e = "e2e"

    @property
    def rank(self) -> int:
        return ["check", "micro", "trace", "e2e"].index(self.value)


class Summary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int
    mean: float
    median: float
    std: float
    min: float
    max: float
    p90: float
    p99: float
    # 95% bootstrap interval of the *median* (expanded percentile, the judge's method:
    # infra_agent.stats.bootstrap); equal to the median when n < 2.  ``ci_stat`` says
    # which statistic the interval is about, so no renderer can pair it with another.
    ci_low: float
    ci_high: float
    ci_stat: Literal["median"] = "median"
    ci_method: Literal["bootstrap"] = "bootstrap"

    @classmethod
    def of(cls, samples: list[float]) -> Summary | None:
        finite = [s for s in samples if math.isfinite(s)]
        if not finite:
            return None
        arr = np.asarray(finite, dtype=np.float64)
        mean = float(arr.mean())
        std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
        from infra_agent.stats.bootstrap import (
            bootstrap_ci,  # scipy: imported only when summarising
        )

        # Thin very long sample lists for the interval only (every 2nd, 3rd... sample
        # keeps the distribution); the point statistics use all of them.
        thin = arr if arr.size <= _CI_MAX_SAMPLES else arr[:: arr.size // _CI_MAX_SAMPLES + 1]
        ci = bootstrap_ci(thin.tolist(), stat="median")
        return cls(
            n=int(arr.size),
            mean=mean,
            median=float(np.median(arr)),
            std=std,
            min=float(arr.min()),
            max=float(arr.max()),
            p90=float(np.percentile(arr, 90)),
            p99=float(np.percentile(arr, 99)),
            ci_low=min(ci.low, float(np.median(arr))),
            ci_high=max(ci.high, float(np.median(arr))),
        )


class Measurement(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    unit: str
    samples: list[float] = Field(default_factory=list)
    summary: Summary | None = None
    # Which way is better; None for metrics that are neither (e.g. a count).
    better: Literal["lower", "higher"] | None = None
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("tags")
    @classmethod
    def _known_locality(cls, tags: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(tags) - set(LOCALITY_KEYS))
        if unknown:
            raise ValueError(f"unknown locality tag(s) {unknown}; expected any of {list(LOCALITY_KEYS)}")
        return tags

    @classmethod
    def from_samples(
        cls,
        name: str,
        unit: str,
        samples: list[float],
        better: Literal["lower", "higher"] | None = None,
        **tags: str,
    ) -> Measurement:
        values = [float(s) for s in samples]
        return cls(name=name, unit=unit, samples=values, summary=Summary.of(values), better=better, tags=tags)

    @property
    def value(self) -> float:
        """The headline number: the median of the samples."""
        assert self.summary is not None, f"measurement {self.name} has no finite samples"
        return self.summary.median


class Location(BaseModel):
    """Where a finding points, and what a hypothesis is about (the same vocabulary).

    ``component`` is a name from :mod:`infra_agent.vocabulary`; ``span`` is an execution
    interval (a span or phase name such as ``queue`` or ``prefill``); ``knob``,
    ``kernel``, ``variant`` and ``precision`` name what the kernel lab and the
    workspace call them.
    """

    model_config = ConfigDict(extra="forbid")

    file: str | None = None
    line: int | None = None
    # The code at ``file:line``, as a profiler names it (``Engine._forward``): the function
    # a change would edit, which a line number alone stops naming after the next edit.
    function: str | None = None
    span: str | None = None
    thread: str | None = None
    kernel: str | None = None
    variant: str | None = None
    precision: str | None = None
    component: str | None = None
    knob: str | None = None

    @field_validator("component")
    @classmethod
    def _known_component(cls, component: str | None) -> str | None:
        if component is not None:
            from infra_agent.vocabulary import check_component

            problem = check_component(component)
            if problem:
                raise ValueError(f"expected {problem}, got {component!r}")
        return component

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(f"{self.file}:{self.line}" if self.line else self.file)
        for key in ("function", "component", "knob", "kernel", "variant", "precision", "span", "thread"):
            val = getattr(self, key)
            if val:
                parts.append(f"{key}={val}")
        return " ".join(parts) or "-"


class Finding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str
    message: str
    severity: Literal["info", "warning", "error"] = "info"
    location: Location | None = None
    evidence: dict[str, Any] = Field(default_factory=dict)
    next_question: str | None = None


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: str  # "trace", "log", "result", "plot", ...
    path: str
    description: str = ""


class Feedback(BaseModel):
    model_config = ConfigDict(extra="forbid")

    probe: str
    tier: Tier
    scope: list[str] = Field(default_factory=list)
    ok: bool = True
    error: str | None = None
    measurements: list[Measurement] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    artifacts: list[Artifact] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Feedback:
        return cls.model_validate_json(text)

    def measurement(self, name: str, **tags: str) -> Measurement:
        for m in self.measurements:
            if m.name == name and all(m.tags.get(k) == v for k, v in tags.items()):
                return m
        raise KeyError(f"no measurement {name!r} with tags {tags} in feedback from {self.probe}")

    def render_text(self, max_measurements: int = 40, max_findings: int = 20) -> str:
        """Compact, line-oriented form for an LLM prompt: one line per fact."""
        head = f"[{self.tier.value}] {self.probe}"
        if self.scope:
            head += f" scope={','.join(self.scope)}"
        head += " ok" if self.ok else f" FAILED: {self.error}"
        lines = [head]
        for m in self.measurements[:max_measurements]:
            tags = " ".join(f"{k}={v}" for k, v in sorted(m.tags.items()))
            if m.summary is None:
                stat = "no samples"
            else:
                s = m.summary
                stat = f"median={_fmt(s.median)} ci95(median)=[{_fmt(s.ci_low)},{_fmt(s.ci_high)}] mean={_fmt(s.mean)} n={s.n}"
            better = f" ({m.better} is better)" if m.better else ""
            lines.append(f"  M {m.name}[{m.unit}] {stat}{better}" + (f" | {tags}" if tags else ""))
        if len(self.measurements) > max_measurements:
            lines.append(f"  ... {len(self.measurements) - max_measurements} more measurements")
        for f in self.findings[:max_findings]:
            loc = f" @ {f.location}" if f.location else ""
            ev = " ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}" for k, v in f.evidence.items())
            lines.append(f"  F[{f.severity}] {f.kind}: {f.message}{loc}" + (f" | {ev}" if ev else ""))
            if f.next_question:
                lines.append(f"    next: {f.next_question}")
        if len(self.findings) > max_findings:
            lines.append(f"  ... {len(self.findings) - max_findings} more findings")
        for a in self.artifacts:
            lines.append(f"  A {a.kind}: {a.path}")
        return "\n".join(lines)


def _fmt(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return str(x)
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.3e}"
    return f"{x:.4g}"
