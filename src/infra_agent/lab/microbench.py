"""``bench``: correctness gate first, then timing, roofline and work accounting.

Order matters (KernelBench's lesson: a skipped correctness check let a 3x slower
kernel report 150x): every (variant, precision) is checked on fresh inputs -- on the
check shapes and once on each bench shape -- before it is timed; a combination that
fails gets no speed number, only the reason.  Ceilings are measured in the same
process on the same device, right before the kernels, so fractions compare like with
like; they are measured again after the kernels and the higher of the two kept, so
a neighbour's burst during one measurement does not inflate every fraction.
On a GPU each entry is timed with its launch hidden (GPU time) and carries the host's
time per call beside it (:mod:`infra_agent.lab.timing`); ``findings`` flags the
entries where the host is the bottleneck.  When the gate ran in workers, the entries
are timed in the candidate's worker too, on the CPU by the judge's clock
(:mod:`infra_agent.lab.judge_clock`): the lab's process never runs the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from infra_agent.lab.bench_report import BenchEntry, BenchReport, EntryStatus, input_key
from infra_agent.lab.check_calls import _Case
from infra_agent.lab.check_isolated import CandidateFault, make_case
from infra_agent.lab.correctness import (
    KERNEL,
    CheckReport,
    ProgressFn,
    check_spec,
    draw_seeds,
)
from infra_agent.lab.judge_clock import time_candidate
from infra_agent.lab.loader import spec_error, variant_part
from infra_agent.lab.roofline import (
    Ceilings,
    classify,
    measure_ceilings,
    merge,
    time_copy_of,
)
from infra_agent.lab.spec import (
    DEFAULT_TIMEOUT_S,
    KernelSpec,
    Shape,
    Variant,
    shape_label,
)
from infra_agent.lab.timing import Method, Timing, time_call
from infra_agent.lab.work import WorkCounter
from infra_agent.lab.worker import LabWorkers, NotIsolatable

# The report's data lives in bench_report; callers import these names from here too.
__all__ = ["BenchEntry", "BenchReport", "EntryStatus", "account_work", "bench_spec", "input_key"]


def _failed_pairs(checks: Sequence[CheckReport]) -> dict[tuple[str, str], str]:
    """(variant, precision) -> why it may not be timed."""
    out: dict[tuple[str, str], str] = {}
    for c in checks:
        for r in c.failures:
            key = (r.variant, r.precision)
            if key not in out:
                cond = r.condition.label() if r.condition else ""
                out[key] = f"failed its check vs {r.against}: {r.message} [{cond}]"
    return out


def account_work(spec: KernelSpec, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """Run each declared work hook on the first check shape; variant -> counted work."""
    out: dict[str, dict[str, Any]] = {}
    hooks = [(KERNEL, spec.work)] + [(v.name, v.work) for v in spec.variants]
    shape = spec.shapes[0]
    for name, hook in hooks:
        if hook is None:
            continue
        inputs = spec.inputs(shape, spec.dtypes[0], 0, device)
        counter = WorkCounter()
        try:
            hook(**inputs, counter=counter)
        except Exception as exc:  # noqa: BLE001 - a broken hook is the spec's fault
            # The unpartitioned kernel's hook is the spec's own ``work=``, not a variant.
            part = "work hook" if name == KERNEL else f"{variant_part(name)}, work hook"
            raise spec_error(spec, part, f"raised {type(exc).__name__}: {exc} for shape [{shape_label(shape)}]") from exc
        out[name] = {"shape": shape_label(shape), **counter.to_dict()}
    return out


def bench_spec(
    spec: KernelSpec,
    device: str | None = None,
    precisions: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    n_seeds: int = 2,
    budget_s: float = 0.3,
    ceilings: Ceilings | None = None,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    method: Method | None = None,
    *,
    timeout_s: float | None = None,
    workers: LabWorkers | None = None,
    progress: ProgressFn | None = None,
) -> BenchReport:
    """Check, then time every passing (variant, precision) against ceilings measured now.

    ``timeout_s``/``workers`` isolate the correctness gate as in ``check_spec`` (a kernel
    that hangs there is refused), and then the timing: each entry runs in the candidate's
    worker.  Without them, both run in this process.
    """
    with ExitStack() as stack:
        if workers is None and timeout_s:
            try:
                workers = stack.enter_context(LabWorkers(spec))  # one pair for both checks and the timing
            except NotIsolatable:
                pass  # check_spec notes why and runs the calls here
        return _bench(spec, device, precisions, variants, n_seeds, budget_s, ceilings, copy_bytes, matmul_n, method,
                      timeout_s, workers, progress)


def _bench(spec: KernelSpec, device: str | None, precisions: Sequence[str] | None, variants: Sequence[str] | None,
           n_seeds: int, budget_s: float, ceilings: Ceilings | None, copy_bytes: int | None, matmul_n: int | None,
           method: Method | None, timeout_s: float | None, workers: LabWorkers | None,
           progress: ProgressFn | None) -> BenchReport:
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    checks, bench_shapes, seed = _gate(spec, dev, precisions, variants, n_seeds, timeout_s, workers, progress)
    report = BenchReport(spec=spec.name, origin=spec.origin, device=dev, checks=checks)
    report.skipped = list(dict.fromkeys(s for c in checks for s in c.skipped))
    if not any(c.results for c in checks):
        return report  # nothing ran (no GPU for a GPU-only spec): no speed claims either

    gpu = dev.startswith("cuda")  # check_spec already returned early if CUDA is missing
    modes = [p for p in (precisions or spec.precisions) if p in spec.precisions and (gpu or p not in spec.gpu_only_precisions)]
    chosen: list[tuple[str, Any]] = [(KERNEL, spec.kernel)]
    chosen += [(v.name, v) for v in spec.variants if (variants is None or v.name in variants) and (gpu or not v.gpu_only)]
    # Timed where the gate ran: in the candidate's worker when the gate was isolated.
    isolated = workers if workers is not None and checks[0].timeout_s is not None else None
    plan = _TimingPlan(spec, dev, seed, modes, chosen, _failed_pairs(checks), budget_s, method, isolated,
                       checks[0].timeout_s or DEFAULT_TIMEOUT_S)

    n_entries = len(bench_shapes) * len(spec.dtypes) * len(modes) * len(chosen)

    def tick() -> None:
        if progress is not None:
            progress(spec.name, len(report.entries), n_entries, "bench entries")

    tick()
    measured_here = ceilings is None
    report.ceilings = ceilings or measure_ceilings(dev, modes, copy_bytes=copy_bytes, matmul_n=matmul_n, budget_s=budget_s)
    for shape in bench_shapes:
        for dtype in spec.dtypes:
            plan.time_input(shape, dtype, report, tick)
    if measured_here:
        after = measure_ceilings(dev, modes, copy_bytes=copy_bytes, matmul_n=matmul_n, budget_s=budget_s)
        report.ceilings = merge(report.ceilings, after)
    _place_on_roofline(report, report.ceilings)
    report.work = account_work(spec, dev)
    return report


def _gate(
    spec: KernelSpec,
    device: str,
    precisions: Sequence[str] | None,
    variants: Sequence[str] | None,
    n_seeds: int,
    timeout_s: float | None,
    workers: LabWorkers | None,
    progress: ProgressFn | None,
) -> tuple[list[CheckReport], list[Shape], int]:
    """The correctness gate: the checks, the shapes to time and the seed of the timed inputs."""
    gate: dict[str, Any] = {"device": device, "precisions": precisions, "variants": variants, "timeout_s": timeout_s,
                            "workers": workers, "progress": progress}
    checks = [check_spec(spec, n_seeds=n_seeds, **gate)]
    bench_shapes = list(spec.bench_shapes or spec.shapes)
    # One fresh seed for the timed inputs; on bench shapes the same inputs are checked.
    seed = (spec.seeds or draw_seeds(1))[0]
    if spec.bench_shapes:
        on_bench = dataclasses.replace(spec, shapes=bench_shapes, seeds=[seed])
        checks.append(check_spec(on_bench, unit="calls on bench shapes", **gate))
    return checks, bench_shapes, seed


@dataclass(frozen=True)
class _TimingPlan:
    """What stays fixed while the bench inputs are timed: the kernels and precisions
    to time, and the (variant, precision) pairs the gate refused."""

    spec: KernelSpec
    device: str
    seed: int
    modes: list[str]
    chosen: list[tuple[str, Any]]
    refused: dict[tuple[str, str], str]
    budget_s: float
    method: Method | None
    workers: LabWorkers | None
    timeout_s: float

    @functools.cached_property
    def job(self) -> dict[str, Any]:
        """How the workers find the spec (checked and built once, not per entry)."""
        assert self.workers is not None
        return self.workers.job_for(self.spec)

    def _inputs(self, shape: Shape, dtype: torch.dtype) -> Any:
        """This input, made here, or by the pristine worker when the entries run in workers."""
        if self.workers is None:
            return self.spec.inputs(shape, dtype, self.seed, self.device)
        case = _Case(self.spec, shape, dtype, self.seed, self.device)
        return make_case(self.workers, {**self.job, "op": "make"}, case, [], self.timeout_s, reference=False)

    def _time(self, entry: BenchEntry, name: str, fn: Any, inputs: Any, precision: str, case: _Case) -> None:
        if self.workers is None:
            _time_entry(entry, fn, inputs, precision, self.device, self.budget_s, self.method)
            return
        key = ("bench", entry.input_key, self.seed)
        try:
            entry.timing = time_candidate(self.workers, self.job, key, case, inputs, name, precision,
                                          budget_s=self.budget_s, method=self.method, timeout_s=self.timeout_s)
        except CandidateFault as fault:
            entry.status = "failed"
            entry.message = fault.message if fault.fault == "raised" else f"while timing: {fault.message}"

    def time_input(self, shape: Shape, dtype: torch.dtype, report: BenchReport, tick: Callable[[], None]) -> None:
        """One entry per (precision, kernel) on this input, then a plain copy of its bytes beside them."""
        spec = self.spec
        inputs = self._inputs(shape, dtype)
        flops = spec.flops(shape) if spec.flops else None
        nbytes = spec.bytes_moved(shape, dtype) if spec.bytes_moved else None
        label, dtype_name = shape_label(shape), str(dtype).replace("torch.", "")
        timed_any = False
        for precision in self.modes:
            for name, target in self.chosen:
                entry = BenchEntry(name, precision, label, dtype_name, "timed", flops=flops, bytes=nbytes)
                if isinstance(target, Variant) and not target.supports(shape):
                    entry.status, entry.message = "skipped", "variant does not apply to this shape"
                elif (name, precision) in self.refused or (KERNEL, precision) in self.refused:
                    entry.status = "refused"
                    entry.message = "no speed reported: " + self.refused.get((name, precision),
                                                                            self.refused.get((KERNEL, precision), ""))
                else:
                    fn = target.fn if isinstance(target, Variant) else target
                    self._time(entry, name, fn, inputs, precision, _Case(spec, shape, dtype, self.seed, self.device))
                    timed_any = timed_any or entry.timing is not None
                report.entries.append(entry)
                tick()
        if nbytes and timed_any:
            key = input_key(label, dtype_name)
            copy = _time_copy(nbytes, self.device, self.budget_s, self.method)
            if isinstance(copy, str):
                report.skipped.append(f"no copy of the bytes of [{key}] beside its entries: {copy}")
            else:
                report.copies[key] = copy


def _place_on_roofline(report: BenchReport, c: Ceilings) -> None:
    """Each timed entry against the ceilings and its input's copy; a fraction above 1 gets a warning."""
    for e in report.entries:
        if e.timing is not None:
            copy = report.copies.get(e.input_key)
            e.roofline = classify(e.flops, e.bytes, e.timing.median_s, c.bandwidth_Bps, c.compute(e.precision),
                                  copy.median_s if copy is not None else None)
            if e.roofline.fraction is not None and e.roofline.fraction > 1.0:
                e.message = "above the measured ceiling: the ceiling measurement was disturbed (shared machine?) or the declared counts are too high"


def _time_copy(nbytes: float, device: str, budget_s: float, method: Method | None) -> Timing | str:
    """The same bytes through a plain copy, or why it could not run (no memory for a second
    copy of the bytes, say): the entries then carry no split, and the report says why."""
    try:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        return time_copy_of(device, nbytes, budget_s=budget_s, method=method)
    except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeErrors (OutOfMemoryError is one)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _time_entry(entry: BenchEntry, fn: Any, inputs: dict[str, Any], precision: str, device: str, budget_s: float, method: Method | None) -> None:
    # Inputs are not cloned per call: an in-place kernel (a decode state) keeps
    # updating the same buffers, as it does in the engine.
    def call() -> Any:
        return fn(**inputs, precision=precision)

    try:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        entry.timing = time_call(call, device, budget_s=budget_s, method=method)
    except Exception as exc:  # noqa: BLE001 - the lab reports, it does not crash
        entry.status, entry.message = "failed", f"raised while timing: {type(exc).__name__}: {exc}"
