"""The correctness gate: candidate against reference, and every partition variant
against the unpartitioned kernel, over seeds x shapes x dtypes x precision modes.

Inputs are fresh every run (seeds are drawn per run unless pinned, and recorded), so a
kernel cannot pass by memorising one input.  A kernel that raises, returns NaN/Inf or
the wrong shape or dtype gives a FAILED result carrying the input condition; the lab
itself does not crash.  A broken *spec* (its input factory or reference throws) is a
``KernelSpecError`` instead, because then there is nothing to judge the kernel by.

With ``timeout_s``, the calls of a spec run in worker processes
(:mod:`infra_agent.lab.worker`: a pristine one makes inputs and reference outputs, a
candidate one runs the kernel and its variants) and are judged in this process; every
call gets that many seconds: a kernel that hangs or kills its process is a failed
result (``fault`` "timeout" or "crashed") for its variant, precision and input, the
worker is replaced, and the remaining calls still run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from infra_agent.lab.check_calls import (
    ProgressFn,
    _Case,
    _Plan,
    _run_case,
    as_outputs,
)
from infra_agent.lab.check_isolated import _check_isolated
from infra_agent.lab.check_report import CheckReport, CheckResult, Fault, Status
from infra_agent.lab.loader import require_declared
from infra_agent.lab.spec import DEFAULT_TIMEOUT_S, KERNEL, KernelSpec, Variant
from infra_agent.lab.worker import LabWorkers, NotIsolatable

# The results are in check_report, the calls and their judging in check_calls, the run
# in a worker process in check_isolated.  The lab (findings, probe, microbench, the CLI)
# and the tests import these names from here; the check worker takes its calls from check_calls.
__all__ = [
    "KERNEL",
    "CheckReport",
    "CheckResult",
    "Fault",
    "ProgressFn",
    "Status",
    "as_outputs",
    "check_spec",
    "draw_seeds",
]


def draw_seeds(n: int) -> list[int]:
    # SystemRandom: independent of any seed the kernel or the spec may have set.
    rng = random.SystemRandom()
    return [rng.randrange(0, 2**31 - 1) for _ in range(n)]


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
    workers: LabWorkers | None = None,
    progress: ProgressFn | None = None,
    unit: str = "calls",
) -> CheckReport:
    """Check ``spec`` on fresh inputs; seeds pinned by the spec or the caller win.

    A precision or variant name the spec does not declare raises ``KernelSpecError``:
    a typo must not turn into a run that checks nothing and reports success.

    ``timeout_s`` (seconds per call) runs the calls in worker processes, one killed
    when a call overruns, and judges them here; ``workers`` reuses a pair (every spec of
    a file, both checks of ``bench``, a candidate's tree), with ``timeout_s`` or
    ``DEFAULT_TIMEOUT_S``.  Without either, the calls run in this process with no
    timeout.  A spec that cannot be
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
    if workers is not None or timeout_s:
        try:
            if workers is not None:
                return _check_isolated(plan, workers, timeout_s or DEFAULT_TIMEOUT_S)
            assert timeout_s is not None
            with LabWorkers(spec) as own:
                return _check_isolated(plan, own, timeout_s)
        except NotIsolatable as exc:  # raised before any call ran
            report.notes.append(f"not isolated ({exc}): the calls ran in the lab's process without a timeout")
    plan.tick()
    for ci, case in enumerate(cases):
        for _key, results in _run_case(case, ci, runnable, chosen):
            plan.record(results)
    return report
