"""The correctness gate: candidate against reference, and every partition variant
against the unpartitioned kernel, over seeds x shapes x dtypes x precision modes.

Inputs are fresh every run (seeds are drawn per run unless pinned, and recorded), so a
kernel cannot pass by memorising one input.  A kernel that raises, returns NaN/Inf or
the wrong shape or dtype gives a FAILED result carrying the input condition; the lab
itself does not crash.  A broken *spec* (its input factory or reference throws) is a
``KernelSpecError`` instead, because then there is nothing to judge the kernel by.

With ``timeout_s``, the checks of a spec run in a worker process
(:mod:`infra_agent.kernels.worker`) and every call gets that many seconds: a kernel
that hangs or kills its process is a failed result (``fault`` "timeout" or
"crashed") for its variant, precision and input, the worker is replaced, and the
remaining calls still run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch

from infra_agent.kernels.loader import require_declared, spec_error
from infra_agent.kernels.numerics import Condition, ErrorStats, compare
from infra_agent.kernels.spec import (
    DEFAULT_TIMEOUT_S,
    KERNEL,
    KernelSpec,
    Shape,
    Tolerance,
    Variant,
    shape_label,
)
from infra_agent.kernels.worker import CheckWorker, NotIsolatable, WorkerDied, WorkerTimeout

Status = Literal["passed", "failed", "skipped"]
# Why a call gave no output to judge: it raised, ran past its timeout, or took its
# worker process down with it.
Fault = Literal["raised", "timeout", "crashed"]
# progress(spec name, calls done, calls in all, unit): called as each call finishes.
ProgressFn = Callable[[str, int, int, str], None]
# A step of a check: ("inputs", case), ("reference", case), ("call", case, precision, variant).
StepKey = tuple[Any, ...]


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


def draw_seeds(n: int) -> list[int]:
    # SystemRandom: independent of any seed the kernel or the spec may have set.
    rng = random.SystemRandom()
    return [rng.randrange(0, 2**31 - 1) for _ in range(n)]


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
    """Run one callable and compare its outputs with ``truth``; never raises for kernel faults."""
    try:
        got = as_outputs(call())
        if case.device.startswith("cuda"):
            # Kernel faults surface at the next sync: make it happen here, inside the try.
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a faulty kernel is a finding, not a crash
        msg = f"raised {type(exc).__name__}: {exc}"
        return [case.result(variant, against, precision, "*", "failed", message=msg, tolerance=tol.describe(), fault="raised")], None
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
    *,
    timeout_s: float | None = None,
    worker: CheckWorker | None = None,
    progress: ProgressFn | None = None,
    unit: str = "calls",
) -> CheckReport:
    """Check ``spec`` on fresh inputs; seeds pinned by the spec or the caller win.

    A precision or variant name the spec does not declare raises ``KernelSpecError``:
    a typo must not turn into a run that checks nothing and reports success.

    ``timeout_s`` (seconds per call) runs the calls in a worker process that is killed
    when a call overruns; ``worker`` reuses one (every spec of a file, both checks of
    ``bench``), with ``timeout_s`` or ``DEFAULT_TIMEOUT_S``.  Without either, the calls
    run in this process with no timeout.  A spec that cannot be
    loaded again in another process (built in code, or with callables replaced after
    loading) runs here as well, and ``notes`` says so.
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

    cases = [_Case(spec, shape, dtype, seed, dev) for shape in spec.shapes for dtype in spec.dtypes for seed in used_seeds]
    plan = _Plan(report, cases, runnable, chosen, progress, unit)
    if worker is not None or timeout_s:
        try:
            if worker is not None:
                return _check_isolated(plan, worker, timeout_s or DEFAULT_TIMEOUT_S)
            assert timeout_s is not None
            with CheckWorker(spec) as own:
                return _check_isolated(plan, own, timeout_s)
        except NotIsolatable as exc:  # raised before any call ran
            report.notes.append(f"not isolated ({exc}): the calls ran in the lab's process without a timeout")
    plan.tick()
    for ci, case in enumerate(cases):
        for _key, results in _run_case(case, ci, runnable, chosen):
            plan.record(results)
    return report


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


def _no_begin(key: StepKey, replay: bool) -> None:
    return None


def _run_case(
    case: _Case,
    ci: int,
    precisions: Sequence[str],
    variants: Sequence[Variant],
    *,
    begin: Callable[[StepKey, bool], None] = _no_begin,
    done: frozenset[StepKey] | set[StepKey] = frozenset(),
    no_baseline: Mapping[tuple[int, str], str] | None = None,
) -> Iterator[tuple[StepKey, list[CheckResult]]]:
    """The calls of one input case, yielding ``(key, results)`` as each finishes.

    ``begin(key, replay)`` is called before each step that runs spec code, so a worker
    can tell its parent what is running.  ``done`` holds calls already recorded (by a
    worker that was killed): they are not yielded again, but the unpartitioned kernel
    is re-run (``replay``) when a variant still needs it as the baseline.
    ``no_baseline`` maps (case, precision) to why there is no kernel output to compare
    variants with.
    """
    spec = case.spec
    no_baseline = no_baseline or {}
    shaped = [v for v in variants if v.supports(case.shape)]
    pending = [("call", ci, p, name) for p in precisions for name in [KERNEL, *(v.name for v in shaped)]]
    if all(k in done for k in pending):
        return
    begin(("inputs", ci), False)
    try:
        inputs = spec.inputs(case.shape, case.dtype, case.seed, case.device)
    except Exception as exc:  # noqa: BLE001
        raise spec_error(spec, "input factory", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
    begin(("reference", ci), False)
    try:
        assert spec.reference is not None
        truth = as_outputs(spec.reference(**_clone(inputs)))
    except Exception as exc:  # noqa: BLE001
        raise spec_error(spec, "reference", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc

    for precision in precisions:
        expected = _expected_dtypes(spec, case.dtype, precision, list(truth))
        kkey = ("call", ci, precision, KERNEL)
        todo = [v for v in shaped if ("call", ci, precision, v.name) not in done]

        def run_kernel(precision: str = precision) -> Any:
            return _call_and_pick(spec, spec.kernel, inputs, precision)

        kernel_out: dict[str, torch.Tensor] | None = None
        reason = no_baseline.get((ci, precision))
        if reason is None and kkey not in done:
            begin(kkey, False)
            kernel_results, kernel_out = _judge(case, KERNEL, "reference", precision, run_kernel, truth, expected, spec.tolerance(precision))
            yield kkey, kernel_results
        elif reason is None and todo:
            begin(kkey, True)  # recorded by an earlier worker; needed again as the baseline
            _, kernel_out = _judge(case, KERNEL, "reference", precision, run_kernel, truth, expected, spec.tolerance(precision))
        for v in todo:
            vkey = ("call", ci, precision, v.name)
            tol = spec.partition_tolerance(v, precision)
            if kernel_out is None:
                msg = reason or "unpartitioned kernel failed on this input; nothing to compare against"
                yield vkey, [case.result(v.name, KERNEL, precision, "*", "skipped", message=msg, tolerance=tol.describe())]
                continue
            # The variant must reproduce the unpartitioned result, in its dtypes.
            kernel_dtypes = {n: t.dtype for n, t in kernel_out.items()}
            fn = v.fn

            def run_variant(fn: Callable[..., Any] = fn, precision: str = precision) -> Any:
                return _call_and_pick(spec, fn, inputs, precision)

            begin(vkey, False)
            var_results, _ = _judge(case, v.name, KERNEL, precision, run_variant, kernel_out, kernel_dtypes, tol)
            yield vkey, var_results


def _check_isolated(plan: _Plan, worker: CheckWorker, timeout_s: float) -> CheckReport:
    """Run the plan in ``worker``, ``timeout_s`` per call; a call that overruns or kills
    the worker is recorded, and a fresh worker continues with the calls after it."""
    report = plan.report
    spec = plan.cases[0].spec if plan.cases else None
    if spec is None or not plan.precisions:
        return report
    job = worker.job_for(spec)  # NotIsolatable before anything ran
    report.timeout_s = timeout_s
    done: set[StepKey] = set()
    no_baseline: dict[tuple[int, str], str] = {}
    job |= {
        "variants": [v.name for v in plan.variants],
        "device": report.device,
        "cases": [(c.shape, c.dtype, c.seed) for c in plan.cases],
        "precisions": plan.precisions,
    }
    plan.tick()
    progress_at_spawn = -1
    while True:
        current: tuple[StepKey, bool] | None = None
        try:
            if not worker.alive:
                progress_at_spawn = plan.done
            worker.send({**job, "done": set(done), "no_baseline": dict(no_baseline)})
            while True:
                kind, *body = worker.recv(timeout_s)
                if kind == "begin":
                    current = (body[0], body[1])
                elif kind == "results":
                    done.add(body[0])
                    current = None
                    plan.record(body[1])
                elif kind == "job_done":
                    return report
                else:
                    raise AssertionError(f"unexpected message from the check worker: {kind}")
        except (WorkerTimeout, WorkerDied) as exc:
            worker.kill()
            what = exc.describe()
            if current is None:
                if isinstance(exc, WorkerDied) and plan.done > progress_at_spawn:
                    continue  # it died between calls after finishing some: go on
                raise spec_error(spec, None, f"the check worker {what} outside any kernel call") from None
            key, replay = current
            if key[0] in ("inputs", "reference"):
                case = plan.cases[key[1]]
                part = "input factory" if key[0] == "inputs" else "reference"
                raise spec_error(spec, part, f"{what} [{case.input_label()}]") from None
            _, ci, precision, name = key
            if replay:
                no_baseline[(ci, precision)] = f"the unpartitioned kernel, run again as the baseline, {what}; nothing to compare against"
                continue
            case = plan.cases[ci]
            if name == KERNEL:
                against, tol = "reference", spec.tolerance(precision)
                no_baseline[(ci, precision)] = f"the unpartitioned kernel {what} on this input; nothing to compare against"
            else:
                against, tol = KERNEL, spec.partition_tolerance(spec.variant(name), precision)
            fault: Fault = "timeout" if isinstance(exc, WorkerTimeout) else "crashed"
            done.add(key)
            plan.record([case.result(name, against, precision, "*", "failed", message=what, tolerance=tol.describe(), fault=fault)])
