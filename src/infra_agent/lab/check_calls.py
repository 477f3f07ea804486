"""The calls of a correctness check, and how each one's outputs are judged.

``_run_case`` makes the calls of one input case (input factory, reference, the
unpartitioned kernel, then each variant against the kernel) and judges them;
``_Plan`` counts the calls of a whole check for progress.  Both the lab's process and
a check worker (:mod:`infra_agent.lab.worker`) run cases through this code, so an
isolated check judges exactly as an in-process one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from infra_agent.lab.check_report import CheckReport, CheckResult, Status
from infra_agent.lab.loader import spec_error
from infra_agent.lab.numerics import Condition, compare
from infra_agent.lab.spec import (
    KERNEL,
    KernelSpec,
    Shape,
    Tolerance,
    Variant,
    shape_label,
)

# progress(spec name, calls done, calls in all, unit): called as each call finishes.
ProgressFn = Callable[[str, int, int, str], None]
# A step of a check: ("inputs", case), ("reference", case), ("call", case, precision, variant).
StepKey = tuple[Any, ...]


def _clone(inputs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _call_and_pick(spec: KernelSpec, fn: Callable[..., Any], inputs: Mapping[str, Any], precision: str) -> Any:
    """One checked call on fresh inputs; the spec's ``outputs`` hook picks what to compare."""
    fresh = _clone(inputs)
    result = fn(**fresh, precision=precision)
    return result if spec.outputs is None else spec.outputs(result, fresh)


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
    """Run one callable here and judge its outputs; never raises for kernel faults."""
    try:
        got = as_outputs(call())
        if case.device.startswith("cuda"):
            # Kernel faults surface at the next sync: make it happen here, inside the try.
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a faulty kernel is a finding, not a crash
        msg = f"raised {type(exc).__name__}: {exc}"
        return [case.result(variant, against, precision, "*", "failed", message=msg, tolerance=tol.describe(), fault="raised")], None
    return judge_outputs(case, variant, against, precision, got, truth, expected_dtypes, tol)


def judge_outputs(
    case: _Case,
    variant: str,
    against: str,
    precision: str,
    got: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
    expected_dtypes: dict[str, torch.dtype],
    tol: Tolerance,
) -> tuple[list[CheckResult], dict[str, torch.Tensor] | None]:
    """Compare named outputs with ``truth``; the outputs too, when they can serve as the
    baseline for variants (every one of the right shape and dtype)."""
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


@dataclass
class _Plan:
    """The calls of one check, and the count of those done (for progress)."""

    report: CheckReport
    cases: list[_Case]
    precisions: list[str]
    variants: list[Variant]
    progress: ProgressFn | None
    unit: str
    done: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        per_case = [1 + sum(1 for v in self.variants if v.supports(c.shape)) for c in self.cases]
        self.total = len(self.precisions) * sum(per_case)

    def tick(self) -> None:
        if self.progress is not None:
            self.progress(self.report.spec, self.done, self.total, self.unit)

    def record(self, results: list[CheckResult]) -> None:
        self.report.results.extend(results)
        self.done += 1
        self.tick()


def _run_case(
    case: _Case, ci: int, precisions: Sequence[str], variants: Sequence[Variant]
) -> Iterator[tuple[StepKey, list[CheckResult]]]:
    """The calls of one input case in this process, yielding ``(key, results)`` as each
    finishes: what the lab does when a check is not isolated (``timeout_s`` 0, or a spec
    built in code).  Isolated checks run the same steps across workers
    (:mod:`infra_agent.lab.check_isolated`)."""
    spec = case.spec
    shaped = [v for v in variants if v.supports(case.shape)]
    try:
        inputs = spec.inputs(case.shape, case.dtype, case.seed, case.device)
    except Exception as exc:  # noqa: BLE001
        raise spec_error(spec, "input factory", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
    try:
        assert spec.reference is not None
        truth = as_outputs(spec.reference(**_clone(inputs)))
    except Exception as exc:  # noqa: BLE001
        raise spec_error(spec, "reference", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc

    for precision in precisions:
        expected = _expected_dtypes(spec, case.dtype, precision, list(truth))

        def run_kernel(precision: str = precision) -> Any:
            return _call_and_pick(spec, spec.kernel, inputs, precision)

        kernel_results, kernel_out = _judge(case, KERNEL, "reference", precision, run_kernel, truth, expected, spec.tolerance(precision))
        yield ("call", ci, precision, KERNEL), kernel_results
        for v in shaped:
            tol = spec.partition_tolerance(v, precision)
            if kernel_out is None:
                msg = "unpartitioned kernel failed on this input; nothing to compare against"
                yield ("call", ci, precision, v.name), [case.result(v.name, KERNEL, precision, "*", "skipped", message=msg, tolerance=tol.describe())]
                continue
            # The variant must reproduce the unpartitioned result, in its dtypes.
            kernel_dtypes = {n: t.dtype for n, t in kernel_out.items()}

            def run_variant(fn: Callable[..., Any] = v.fn, precision: str = precision) -> Any:
                return _call_and_pick(spec, fn, inputs, precision)

            var_results, _ = _judge(case, v.name, KERNEL, precision, run_variant, kernel_out, kernel_dtypes, tol)
            yield ("call", ci, precision, v.name), var_results
