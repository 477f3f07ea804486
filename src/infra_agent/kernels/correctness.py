"""The correctness gate: candidate against reference, and every partition variant
against the unpartitioned kernel, over seeds x shapes x dtypes x precision modes.

Inputs are fresh every run (seeds are drawn per run unless pinned, and recorded), so a
kernel cannot pass by memorising one input.  A kernel that raises, returns NaN/Inf or
the wrong shape or dtype gives a FAILED result carrying the input condition; the lab
itself does not crash.  A broken *spec* (its input factory or reference throws) is a
``KernelSpecError`` instead, because then there is nothing to judge the kernel by.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from infra_agent.kernels.loader import require_declared, spec_error
from infra_agent.kernels.numerics import Condition, ErrorStats, compare
from infra_agent.kernels.spec import (
    KERNEL,
    KernelSpec,
    Shape,
    Tolerance,
    Variant,
    shape_label,
)

Status = Literal["passed", "failed", "skipped"]


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
            "results": [r.to_dict() for r in self.results],
        }


def _badness(r: CheckResult) -> tuple[int, float]:
    # Failures first, then the largest relative Frobenius error.
    return (1 if r.status == "failed" else 0, r.stats.rel_fro if r.stats else float("inf"))


def draw_seeds(n: int) -> list[int]:
    # SystemRandom: independent of any seed the kernel or the spec may have set.
    rng = random.SystemRandom()
    return [rng.randrange(0, 2**31 - 1) for _ in range(n)]


def _clone(inputs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def as_outputs(value: Any) -> dict[str, torch.Tensor]:
    """Name a kernel's result: ``out``, ``out0..`` for a tuple, or the dict's keys."""
    if isinstance(value, torch.Tensor):
        return {"out": value}
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return {f"out{i}": v for i, v in enumerate(value)}
    if isinstance(value, Mapping) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    raise TypeError(f"expected a tensor, a tuple of tensors or a dict of tensors, got {type(value).__name__}")


def _expected_dtypes(spec: KernelSpec, dtype: torch.dtype, precision: str, names: Sequence[str]) -> dict[str, torch.dtype]:
    if spec.out_dtypes is None:
        return {n: dtype for n in names}
    declared = spec.out_dtypes(dtype, precision)
    if isinstance(declared, torch.dtype):
        return {n: declared for n in names}
    return {n: declared.get(n, dtype) for n in names}


@dataclass
class _Case:
    spec: KernelSpec
    shape: Shape
    dtype: torch.dtype
    seed: int
    device: str

    def condition(self, variant: str, precision: str, output: str = "out") -> Condition:
        return Condition(
            spec=self.spec.name,
            variant=variant,
            shape=shape_label(self.shape),
            dtype=str(self.dtype).replace("torch.", ""),
            seed=self.seed,
            precision=precision,
            device=self.device,
            output=output,
        )

    def input_label(self) -> str:
        # The input factory and the reference see no variant or precision mode: the
        # condition that reproduces their failure is the input alone.
        dtype = str(self.dtype).replace("torch.", "")
        return f"shape=[{shape_label(self.shape)}] dtype={dtype} seed={self.seed} device={self.device}"

    def result(self, variant: str, against: str, precision: str, output: str, status: Status, **kw: Any) -> CheckResult:
        return CheckResult(
            variant=variant,
            against=against,
            precision=precision,
            shape=shape_label(self.shape),
            dtype=str(self.dtype).replace("torch.", ""),
            seed=self.seed,
            output=output,
            status=status,
            condition=self.condition(variant, precision, output),
            **kw,
        )


def _judge(
    case: _Case,
    variant: str,
    against: str,
    precision: str,
    call: Callable[[], Any],
    truth: dict[str, torch.Tensor],
    expected_dtypes: dict[str, torch.dtype],
    tol: Tolerance,
) -> tuple[list[CheckResult], dict[str, torch.Tensor] | None]:
    """Run one callable and compare its outputs with ``truth``; never raises for kernel faults."""
    try:
        got = as_outputs(call())
        if case.device.startswith("cuda"):
            # Kernel faults surface at the next sync: make it happen here, inside the try.
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a faulty kernel is a finding, not a crash
        msg = f"raised {type(exc).__name__}: {exc}"
        return [case.result(variant, against, precision, "*", "failed", message=msg, tolerance=tol.describe())], None
    if sorted(got) != sorted(truth):
        msg = f"returned outputs {sorted(got)}, expected {sorted(truth)}"
        return [case.result(variant, against, precision, "*", "failed", message=msg, tolerance=tol.describe())], None
    results = []
    for name, ref in truth.items():
        out = got[name]
        cond = case.condition(variant, precision, name)
        if tuple(out.shape) != tuple(ref.shape):
            msg = f"wrong shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
        elif out.dtype != expected_dtypes[name]:
            msg = f"wrong dtype {out.dtype}, expected {expected_dtypes[name]}"
        else:
            msg = ""
        if msg:
            results.append(case.result(variant, against, precision, name, "failed", message=msg, tolerance=tol.describe()))
            continue
        stats = compare(out, ref, tol, cond)
        status: Status = "passed" if stats.passed else "failed"
        results.append(
            case.result(variant, against, precision, name, status, stats=stats, message=stats.reason, tolerance=tol.describe())
        )
    # Outputs of the right shape and dtype can serve as the baseline for variants,
    # even when they miss the reference: partitions must agree with the kernel as is.
    well_formed = all(r.stats is not None for r in results)
    return results, (got if well_formed else None)


def _gpu_ready(device: str) -> bool:
    return device.startswith("cuda") and torch.cuda.is_available()


def check_spec(
    spec: KernelSpec,
    seeds: Sequence[int] | None = None,
    n_seeds: int = 2,
    device: str | None = None,
    precisions: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
) -> CheckReport:
    """Check ``spec`` on fresh inputs; seeds pinned by the spec or the caller win.

    A precision or variant name the spec does not declare raises ``KernelSpecError``:
    a typo must not turn into a run that checks nothing and reports success.
    """
    require_declared(spec, precisions, variants)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    used_seeds = list(spec.seeds or seeds or draw_seeds(n_seeds))
    report = CheckReport(spec=spec.name, origin=spec.origin, device=dev, seeds=used_seeds)
    if dev.startswith("cuda") and not torch.cuda.is_available():
        report.skipped.append(f"device {dev} requested but no CUDA device is available; nothing was checked")
        return report
    if spec.gpu_only and not _gpu_ready(dev):
        report.skipped.append(f"spec '{spec.name}' is GPU-only; skipped on {dev}")
        return report

    modes = list(precisions or spec.precisions)
    runnable = []
    for p in modes:
        if p in spec.gpu_only_precisions and not _gpu_ready(dev):
            report.skipped.append(f"precision {p} is GPU-only; skipped on {dev}")
        else:
            runnable.append(p)
    chosen: list[Variant] = [v for v in spec.variants if variants is None or v.name in variants]
    for v in chosen:
        if v.gpu_only and not _gpu_ready(dev):
            report.skipped.append(f"variant {v.name} is GPU-only; skipped on {dev}")
    chosen = [v for v in chosen if not (v.gpu_only and not _gpu_ready(dev))]

    for shape in spec.shapes:
        for dtype in spec.dtypes:
            for seed in used_seeds:
                case = _Case(spec, shape, dtype, seed, dev)
                report.results.extend(_check_case(case, runnable, chosen))
    return report


def _check_case(case: _Case, precisions: Sequence[str], variants: Sequence[Variant]) -> list[CheckResult]:
    spec = case.spec
    try:
        inputs = spec.inputs(case.shape, case.dtype, case.seed, case.device)
    except Exception as exc:  # noqa: BLE001
        raise spec_error(spec, "input factory", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
    try:
        assert spec.reference is not None
        truth = as_outputs(spec.reference(**_clone(inputs)))
    except Exception as exc:  # noqa: BLE001
        raise spec_error(spec, "reference", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc

    results: list[CheckResult] = []
    for precision in precisions:
        expected = _expected_dtypes(spec, case.dtype, precision, list(truth))
        kernel_results, kernel_out = _judge(
            case, KERNEL, "reference", precision,
            lambda: spec.kernel(**_clone(inputs), precision=precision),
            truth, expected, spec.tolerance(precision),
        )
        results.extend(kernel_results)
        for v in variants:
            if not v.supports(case.shape):
                continue
            tol = spec.partition_tolerance(v, precision)
            if kernel_out is None:
                msg = "unpartitioned kernel failed on this input; nothing to compare against"
                results.append(case.result(v.name, KERNEL, precision, "*", "skipped", message=msg, tolerance=tol.describe()))
                continue
            # The variant must reproduce the unpartitioned result, in its dtypes.
            kernel_dtypes = {n: t.dtype for n, t in kernel_out.items()}
            fn = v.fn
            var_results, _ = _judge(
                case, v.name, KERNEL, precision,
                lambda: fn(**_clone(inputs), precision=precision),
                kernel_out, kernel_dtypes, tol,
            )
            results.extend(var_results)
    return results
