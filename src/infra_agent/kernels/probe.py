"""``KernelProbe``: the kernel lab as Feedback.

Config keys: ``spec`` (path, required), ``spec_name``, ``mode`` ("check" -> tier
check, "bench" -> tier micro: see ``KernelProbe.tier_for``), ``seeds`` (how many to
draw, shared by every shape and dtype), ``device``,
``precisions``, ``variants``, ``budget_s`` (CPU timing budget per entry),
``copy_bytes`` and ``matmul_n`` (ceiling sizes).  The measurements and findings are
built in :mod:`infra_agent.kernels.findings`.

``ok`` is False when a check failed, bench refused an entry or an entry raised while
timed, and also when nothing was checked at all (every case skipped: no GPU for a
GPU-only spec, ``device=cuda`` without one); ``meta["checked"]`` counts comparisons.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from infra_agent.errors import ConfigError
from infra_agent.feedback import Artifact, Feedback, Finding, Measurement, Tier
from infra_agent.kernels.correctness import CheckReport, check_spec
from infra_agent.kernels.findings import (  # re-exported: callers import them from here
    bench_feedback_parts,
    check_feedback_parts,
    error_measurement,
    work_findings,
)
from infra_agent.kernels.loader import load_specs, narrow, select
from infra_agent.kernels.microbench import BenchReport, account_work, bench_spec
from infra_agent.kernels.spec import KernelSpec
from infra_agent.probes.base import Probe, ProbeContext

__all__ = ["KernelProbe", "bench_feedback_parts", "check_feedback_parts", "error_measurement", "run_lab", "work_findings"]


MODE_TIERS: dict[str, Tier] = {"check": Tier.check, "bench": Tier.micro}


def _mode(config: dict[str, Any]) -> str:
    mode = config.get("mode", "check")
    if mode not in MODE_TIERS:
        raise ConfigError(None, "mode", "'check' or 'bench'", mode)
    return str(mode)


class KernelProbe(Probe):
    """The kernel lab as a probe.

    ``tier`` is the cheapest tier it runs at (``check``: correctness only), which is
    what a planner ordering probes by cost should see.  What one run costs depends on
    its config: ``tier_for(config)`` is ``micro`` for ``mode="bench"`` (kernels are
    timed against measured ceilings), and the Feedback's ``tier`` always equals it.
    """

    name: ClassVar[str] = "kernel"
    tier: ClassVar[Tier] = Tier.check

    @classmethod
    def tier_for(cls, config: dict[str, Any]) -> Tier:
        """The tier a run with ``config`` returns Feedback at; ConfigError for a bad mode."""
        return MODE_TIERS[_mode(config)]

    @property
    def scope(self) -> list[str]:
        return ["kernel", "variant", "precision"]

    def run(self, config: dict[str, Any], ctx: ProbeContext) -> Feedback:
        path = config.get("spec")
        if not path:
            raise ConfigError(None, "spec", "a path to a kernel spec file", path)
        mode = _mode(config)
        specs = select(load_specs(path), config.get("spec_name"))
        fb, reports = run_lab(specs, mode, config)
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


def run_lab(specs: list[KernelSpec], mode: str, config: dict[str, Any]) -> tuple[Feedback, list[CheckReport | BenchReport]]:
    """Check or bench every spec; the Feedback plus the reports it was built from.

    Raises ``KernelSpecError`` for a precision or variant name no selected spec declares.
    """
    mode = _mode({"mode": mode})
    ms: list[Measurement] = []
    fs: list[Finding] = []
    reports: list[CheckReport | BenchReport] = []
    n_seeds = int(config.get("seeds", 2))
    # Counted apart so a failing check and the bench entry it refuses are not one
    # number twice; a failed check is one table row (variant, vs, precision, output),
    # the same row on check and bench shapes counting once.
    failed: set[tuple[str, str, str, str, str]] = set()
    refused = timing_failed = checked = 0
    for spec, precisions, variants, notes in narrow(specs, _names(config.get("precisions")), _names(config.get("variants"))):
        common: dict[str, Any] = {"device": config.get("device"), "precisions": precisions, "variants": variants}
        if precisions == []:  # declares none of the requested modes: nothing to run
            dev = config.get("device") or "-"
            placeholder = CheckReport(spec.name, spec.origin, dev, [], skipped=notes)
            reports.append(placeholder if mode == "check" else BenchReport(spec.name, spec.origin, dev, [], skipped=notes))
            fs += check_feedback_parts(placeholder)[1]
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
            refused += len(bench.refused)
            timing_failed += len(bench.timing_failures)
            reports.append(bench)
        else:
            checks = [check_spec(spec, n_seeds=n_seeds, **common)]
            m, f = [], []
            work = account_work(spec)
            reports.append(checks[0])
        checks[0].skipped[:0] = notes
        for check in checks:
            cm, cf = check_feedback_parts(check)
            ms += cm
            fs += cf
            checked += check.checked
            failed |= {(spec.name, r.variant, r.against, r.precision, r.output) for r in check.rows() if r.status == "failed"}
        ms += m
        fs += f
        m, f = work_findings(spec.name, spec.origin, work)
        ms += m
        fs += f
    fs = _unique_skips(fs)
    skipped = [f.message for f in fs if f.kind == "skipped"]
    problems = [
        _plural(len(failed), "failed check", "failed checks") if failed else "",
        _plural(refused, "refused bench entry", "refused bench entries") if refused else "",
        _plural(timing_failed, "bench entry", "bench entries") + " raised while timed" if timing_failed else "",
    ]
    if checked == 0:
        # Everything was skipped: there is no result to call a success.
        error: str | None = "nothing was checked: " + ("; ".join(skipped) or "no case ran")
    else:
        error = ", ".join(p for p in problems if p) or None
    fb = Feedback(
        probe="kernel",
        tier=MODE_TIERS[mode],
        scope=[s.name for s in specs],
        ok=error is None,
        error=error,
        measurements=ms,
        findings=fs,
        meta={
            "mode": mode, "specs": [s.name for s in specs], "origin": specs[0].origin if specs else None,
            "checked": checked, "skipped": skipped,
            "failed_checks": len(failed), "refused_entries": refused, "timing_failures": timing_failed,
        },
    )
    return fb, reports
