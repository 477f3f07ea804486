"""``KernelProbe``: the kernel lab as Feedback.

Config (``KernelConfig``): ``spec`` (path, required), ``spec_name``, ``mode`` ("check"
-> tier check, "bench" -> tier micro: see ``KernelProbe.tier``), ``seeds`` (how many
to draw, shared by every shape and dtype), ``device``, ``precisions``, ``variants``,
``timeout_s`` (seconds per kernel call in the check worker; 0 runs the calls in this
process without a timeout), ``budget_s`` (CPU timing budget per entry), ``copy_bytes``
and ``matmul_n`` (ceiling sizes).  The measurements and findings are built in
:mod:`infra_agent.lab.findings`.

``ok`` is False when a check failed, bench refused an entry or an entry raised while
timed, and also when nothing was checked at all (every case skipped: no GPU for a
GPU-only spec, ``device=cuda`` without one); ``meta["checked"]`` counts comparisons.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from infra_agent.errors import ConfigError
from infra_agent.feedback import Artifact, Feedback, Finding, Measurement, Tier
from infra_agent.lab.correctness import CheckReport, ProgressFn, check_spec
from infra_agent.lab.findings import (  # re-exported: callers import them from here
    bench_feedback_parts,
    check_feedback_parts,
    error_measurement,
    work_findings,
)
from infra_agent.lab.judge_files import judge_files
from infra_agent.lab.loader import load_specs, narrow, select
from infra_agent.lab.microbench import BenchReport, account_work, bench_spec
from infra_agent.lab.progress import LabProgress
from infra_agent.lab.spec import DEFAULT_TIMEOUT_S, KernelSpec
from infra_agent.lab.worker import LabWorkers, NotIsolatable
from infra_agent.probes.base import Probe, ProbeConfig, ProbeContext

__all__ = ["KernelProbe", "bench_feedback_parts", "check_feedback_parts", "error_measurement", "run_lab", "work_findings"]


MODE_TIERS: dict[str, Tier] = {"check": Tier.check, "bench": Tier.micro}


def _mode(config: dict[str, Any]) -> str:
    mode = config.get("mode", "check")
    if mode not in MODE_TIERS:
        raise ConfigError(None, "mode", "'check' or 'bench'", mode)
    return str(mode)


class KernelConfig(ProbeConfig):
    """One kernel-lab run: which spec, which mode, which cases."""

    spec: str = Field(min_length=1, description="path to a kernel spec file")
    spec_name: str | None = Field(None, description="one spec of a file that declares several")
    mode: Literal["check", "bench"] = Field("check", description="check: correctness (tier check); bench: timing (tier micro)")
    seeds: int = Field(2, ge=1, le=1000, description="random seeds drawn, shared by every shape and dtype")
    device: str | None = None
    precisions: list[str] | str | None = Field(None, description="precision modes to run, e.g. ['tf32'] or 'tf32,3xtf32'")
    variants: list[str] | str | None = None
    timeout_s: float | None = Field(
        None, ge=0,
        description=f"seconds each kernel call may take in the check worker (default: the spec's timeout_s, else {DEFAULT_TIMEOUT_S:g}); 0 runs the calls in this process without a timeout",
    )
    budget_s: float = Field(0.3, gt=0, description="CPU timing budget per bench entry")
    copy_bytes: int | None = Field(None, gt=0)
    matmul_n: int | None = Field(None, gt=0)


class KernelProbe(Probe):
    """The kernel lab as a probe.

    ``base_tier`` is the cheapest tier it runs at (``check``: correctness only), which
    is what a planner ordering probes by cost should see.  ``tier(config)`` is ``micro``
    for ``mode="bench"`` (kernels are timed against measured ceilings), and the
    Feedback's ``tier`` always equals it.
    """

    name: ClassVar[str] = "kernel"
    base_tier: ClassVar[Tier] = Tier.check
    Config: ClassVar[type[ProbeConfig]] = KernelConfig
    components: ClassVar[tuple[str, ...]] = ("kernel", "model")
    locality: ClassVar[tuple[str, ...]] = ("kernel", "variant", "precision", "span")

    @classmethod
    def measures(cls, metric: str) -> bool:
        # Counts in meta, the error metrics of checks, and the timings and rates of benches;
        # never a serving metric.
        from infra_agent.workspace.models import metric_direction

        return metric in ("failed_checks", "checked", "refused_entries", "timing_failures", "timed_out", "crashed") or (
            metric_direction(metric) is None and not metric.endswith("_ms"))

    @classmethod
    def tier(cls, config: ProbeConfig | None = None) -> Tier:
        if config is None:
            return cls.base_tier
        return MODE_TIERS[config.mode]  # type: ignore[attr-defined]

    def run(self, config: Any, ctx: ProbeContext) -> Feedback:
        cfg: KernelConfig = self.parse_config(config)  # type: ignore[assignment]
        mode = cfg.mode
        # The judge loads the spec from the tree it runs in (the pristine one, when the
        # code under test lives in another: ctx.candidate_root), never the candidate's.
        specs = select(load_specs(cfg.spec), cfg.spec_name)
        with LabProgress(mode, enabled=ctx.progress) as progress:
            fb, reports = run_lab(specs, mode, cfg.model_dump(exclude_none=True), progress=progress,
                                  candidate_root=ctx.candidate_root)
        # What the verdict rests on, for the executor to keep out of a candidate's reach.
        fb.meta["judge_files"] = judge_files(specs, Path.cwd())
        ctx.workdir.mkdir(parents=True, exist_ok=True)
        out = ctx.workdir / f"kernel-{mode}-{'_'.join(s.name for s in specs)[:80]}.json"
        out.write_text(json.dumps([r.to_dict() for r in reports], indent=2, default=str))
        fb.artifacts.append(Artifact(kind="result", path=str(out), description=f"kernel {mode} report"))
        return fb


def _names(value: Any) -> list[str] | None:
    """A list from YAML/CLI config: ``["tf32", "bf16"]`` or ``"tf32,bf16"``."""
    if value is None:
        return None
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _unique_skips(fs: list[Finding]) -> list[Finding]:
    # Check and bench shapes skip for the same reasons: say each once.
    seen: set[str] = set()
    out: list[Finding] = []
    for f in fs:
        if f.kind == "skipped":
            if f.message in seen:
                continue
            seen.add(f.message)
        out.append(f)
    return out


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def timeout_for(spec: KernelSpec, configured: float | None, *, isolate: bool = False) -> float | None:
    """Seconds per call: the configured value, else the spec's, else the default.

    None (from a configured 0) means no worker and no timeout, unless ``isolate``: code
    under test from another tree never runs in the judge's process.
    """
    if configured is not None and (float(configured) or not isolate):
        return float(configured) or None
    return spec.timeout_s or DEFAULT_TIMEOUT_S


def candidate_file(spec: KernelSpec, candidate_root: Path | None) -> str | None:
    """The candidate's copy of ``spec``'s file: the same path relative to the candidate's
    tree as the spec's is to this one (the working directory); None when there is no
    candidate tree, or the file lies outside this tree (then both load the same file)."""
    if candidate_root is None or spec.source is None:
        return None
    try:
        rel = Path(spec.source.origin).resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return None
    return str(candidate_root / rel)


def run_lab(
    specs: list[KernelSpec], mode: str, config: dict[str, Any], progress: ProgressFn | None = None,
    candidate_root: Path | None = None,
) -> tuple[Feedback, list[CheckReport | BenchReport]]:
    """Check or bench every spec; the Feedback plus the reports it was built from.

    Each spec file's calls run in one pair of worker processes (pristine: inputs and
    reference; candidate: kernel and variants, from ``candidate_root`` when given), every
    call bounded by ``timeout_for(spec, config["timeout_s"])``, and are judged here.
    Raises ``KernelSpecError`` for a precision or variant name no selected spec declares.
    """
    with ExitStack() as stack:
        pairs: dict[str, LabWorkers | None] = {}

        def workers_for(spec: KernelSpec) -> LabWorkers | None:
            if spec.origin not in pairs:
                try:
                    pairs[spec.origin] = stack.enter_context(
                        LabWorkers(spec, candidate_file(spec, candidate_root), candidate_root))
                except NotIsolatable:
                    pairs[spec.origin] = None  # check_spec says why, and runs it here
            w = pairs[spec.origin]
            return w if w is not None and spec.source is not None and spec.source.origin == w.source[0] else None

        return _run_lab(specs, mode, config, progress, workers_for, isolate=candidate_root is not None)


# A failed check is one table row: (spec, variant, vs, precision, output).
_Row = tuple[str, str, str, str, str]


@dataclass
class _Tally:
    """What the specs of one lab run add up to, while they run."""

    measurements: list[Measurement] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    reports: list[CheckReport | BenchReport] = field(default_factory=list)
    # Counted apart so a failing check and the bench entry it refuses are not one
    # number twice; a failed check is one table row (variant, vs, precision, output),
    # the same row on check and bench shapes counting once.
    failed: set[_Row] = field(default_factory=set)
    faults: dict[str, set[_Row]] = field(default_factory=lambda: {"timeout": set(), "crashed": set()})
    refused: int = 0
    timing_failed: int = 0
    checked: int = 0

    def add_checks(self, spec: KernelSpec, checks: list[CheckReport]) -> None:
        for check in checks:
            cm, cf = check_feedback_parts(check)
            self.measurements += cm
            self.findings += cf
            self.checked += check.checked
            for r in check.rows():
                if r.status == "failed":
                    self.failed.add((spec.name, r.variant, r.against, r.precision, r.output))
                    if r.fault in ("timeout", "crashed"):
                        self.faults[r.fault].add((spec.name, r.variant, r.against, r.precision, r.output))

    def error(self, skipped: list[str]) -> str | None:
        """The run's error: what failed, or that nothing was checked at all; None when all is well."""
        how = ", ".join(f"{len(keys)} {'timed out' if fault == 'timeout' else 'crashed'}"
                        for fault, keys in self.faults.items() if keys)
        problems = [
            _plural(len(self.failed), "failed check", "failed checks") + (f" ({how})" if how else "") if self.failed else "",
            _plural(self.refused, "refused bench entry", "refused bench entries") if self.refused else "",
            _plural(self.timing_failed, "bench entry", "bench entries") + " raised while timed" if self.timing_failed else "",
        ]
        if self.checked == 0:
            # Everything was skipped: there is no result to call a success.
            return "nothing was checked: " + ("; ".join(skipped) or "no case ran")
        return ", ".join(p for p in problems if p) or None


def _run_lab(specs: list[KernelSpec], mode: str, config: dict[str, Any], progress: ProgressFn | None, workers_for: Any,
             isolate: bool = False) -> tuple[Feedback, list[CheckReport | BenchReport]]:
    mode = _mode({"mode": mode})
    tally = _Tally()
    n_seeds = int(config.get("seeds", 2))
    for spec, precisions, variants, notes in narrow(specs, _names(config.get("precisions")), _names(config.get("variants"))):
        timeout_s = timeout_for(spec, config.get("timeout_s"), isolate=isolate)
        common: dict[str, Any] = {
            "device": config.get("device"), "precisions": precisions, "variants": variants,
            "timeout_s": timeout_s, "workers": workers_for(spec) if timeout_s else None, "progress": progress,
        }
        if precisions == []:  # declares none of the requested modes: nothing to run
            dev = config.get("device") or "-"
            placeholder = CheckReport(spec.name, spec.origin, dev, [], skipped=notes)
            tally.reports.append(placeholder if mode == "check" else BenchReport(spec.name, spec.origin, dev, [], skipped=notes))
            tally.findings += check_feedback_parts(placeholder)[1]
            continue
        if mode == "bench":
            bench = bench_spec(
                spec, n_seeds=n_seeds, budget_s=float(config.get("budget_s", 0.3)),
                copy_bytes=config.get("copy_bytes"), matmul_n=config.get("matmul_n"), **common,
            )
            bench.skipped[:0] = notes
            checks = bench.checks
            m, f = bench_feedback_parts(bench)
            work = bench.work
            tally.refused += len(bench.refused)
            tally.timing_failed += len(bench.timing_failures)
            tally.reports.append(bench)
        else:
            checks = [check_spec(spec, n_seeds=n_seeds, **common)]
            m, f = [], []
            work = account_work(spec)
            tally.reports.append(checks[0])
        checks[0].skipped[:0] = notes
        tally.add_checks(spec, checks)
        tally.measurements += m
        tally.findings += f
        m, f = work_findings(spec.name, spec.origin, work)
        tally.measurements += m
        tally.findings += f
    return _lab_feedback(specs, mode, tally), tally.reports


def _lab_feedback(specs: list[KernelSpec], mode: str, tally: _Tally) -> Feedback:
    fs = _unique_skips(tally.findings)
    skipped = [f.message for f in fs if f.kind == "skipped"]
    error = tally.error(skipped)
    return Feedback(
        probe="kernel",
        tier=MODE_TIERS[mode],
        scope=[s.name for s in specs],
        ok=error is None,
        error=error,
        measurements=tally.measurements,
        findings=fs,
        meta={
            "mode": mode, "specs": [s.name for s in specs], "origin": specs[0].origin if specs else None,
            "checked": tally.checked, "skipped": skipped,
            "failed_checks": len(tally.failed), "refused_entries": tally.refused, "timing_failures": tally.timing_failed,
            "timed_out": len(tally.faults["timeout"]), "crashed": len(tally.faults["crashed"]),
        },
    )
