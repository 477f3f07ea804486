"""A correctness check judged in the lab's process from what two workers produce.

For each input case the pristine worker makes the inputs and the reference's outputs;
the candidate worker gets copies of the inputs (staged once per case) and returns the
outputs of the kernel and of each variant; this process compares them
(:func:`infra_agent.lab.check_calls.judge_outputs`).  The candidate never sees the
reference's outputs, and nothing it runs can reach the comparison or its tolerances.

Every call is bounded by ``timeout_s``: a candidate call that overruns, takes its worker
down or answers with bytes the lab cannot read is a failed result for that call
(``fault`` "timeout" or "crashed"), and a fresh candidate worker goes on with the calls
after it.  A fault on the pristine side (the input factory or the reference) is a
``KernelSpecError``: then there is nothing to judge the kernel by.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from infra_agent.lab.check_calls import _Case, _Plan, judge_outputs
from infra_agent.lab.check_report import CheckReport, CheckResult, Fault
from infra_agent.lab.loader import spec_error
from infra_agent.lab.spec import KERNEL, Tolerance, shape_label
from infra_agent.lab.wire import Garbled, tensors_by_name, to_device
from infra_agent.lab.worker import CheckWorker, LabWorkers, WorkerDied, WorkerTimeout


@dataclass
class Made:
    """One case as the pristine worker made it: inputs, reference outputs, and the dtypes
    each precision mode must return."""

    inputs: dict[str, Any]
    truth: dict[str, torch.Tensor] | None
    expected: dict[str, dict[str, torch.dtype]] | None


class CandidateFault(Exception):
    """A candidate call that did not return outputs: why, and the fault to record."""

    def __init__(self, message: str, fault: Fault) -> None:
        super().__init__(message)
        self.message, self.fault = message, fault


def make_case(workers: LabWorkers, job: dict[str, Any], case: _Case, precisions: list[str], timeout_s: float,
              *, reference: bool = True) -> Made:
    """Inputs (and, with ``reference``, the reference's outputs) from the pristine worker."""
    worker = workers.pristine
    part = None
    try:
        worker.send({**job, "case": (case.shape, case.dtype, case.seed, case.device), "precisions": precisions,
                     "reference": reference})
        while True:
            kind, *body = worker.recv(timeout_s)
            if kind == "begin":
                part = "input factory" if body[0] == "inputs" else "reference"
            elif kind == "made":
                worker.done()
                return Made(*body)
            else:
                raise Garbled(f"unexpected message {kind!r}")
    except (WorkerTimeout, WorkerDied, Garbled) as exc:
        worker.kill()
        what = exc.describe() if isinstance(exc, (WorkerTimeout, WorkerDied)) else f"sent an unreadable reply ({exc})"
        if part is None:
            raise spec_error(case.spec, None, f"the pristine check worker {what} outside any spec call") from None
        raise spec_error(case.spec, part, f"{what} [{case.input_label()}]") from None


def stage(worker: CheckWorker, job: dict[str, Any], key: Any, made: Made, device: str, timeout_s: float) -> None:
    """Copies of the case's inputs into the candidate worker, once per worker and case."""
    if worker.staged == key and worker.alive:
        return
    worker.send({**job, "op": "stage", "key": key, "inputs": made.inputs, "device": device})
    kind, *_ = worker.recv(timeout_s)
    if kind != "staged":
        raise Garbled(f"unexpected message {kind!r}")
    worker.done()
    worker.staged = key


def raised(kind: str, body: list[Any]) -> CandidateFault | None:
    """The candidate's exception, when that is what a reply says."""
    return CandidateFault(body[0], "raised") if kind == "raised" and body and isinstance(body[0], str) else None


@contextmanager
def candidate_faults(worker: CheckWorker, *, kill_on_raised: bool = False) -> Iterator[None]:
    """A worker that overran, died or answered garbage as ``CandidateFault``, the worker killed so
    the next call starts a fresh one; with ``kill_on_raised``, also after the kernel raised (the
    worker may be mid-protocol)."""
    try:
        yield
    except (WorkerTimeout, WorkerDied) as exc:
        worker.kill()
        raise CandidateFault(exc.describe(), "timeout" if isinstance(exc, WorkerTimeout) else "crashed") from None
    except Garbled as exc:
        worker.kill()
        raise CandidateFault(f"sent a reply the lab cannot read ({exc}); its worker process was killed", "crashed") from None
    except CandidateFault:
        if kill_on_raised:
            worker.kill()
        raise


def call_candidate(worker: CheckWorker, job: dict[str, Any], key: Any, made: Made, device: str, variant: str,
                   precision: str, timeout_s: float) -> dict[str, torch.Tensor]:
    """The candidate's outputs for one call, or ``CandidateFault``."""
    with candidate_faults(worker):
        stage(worker, job, key, made, device, timeout_s)
        worker.send({**job, "op": "call", "key": key, "variant": variant, "precision": precision, "device": device})
        kind, *body = worker.recv(timeout_s)
        worker.done()
        fault = raised(kind, body)
        if fault is not None:
            raise fault
        if kind != "out" or len(body) != 1:
            raise Garbled(f"unexpected message {kind!r}")
        got = tensors_by_name(body[0])
    return to_device(got, device) if device.startswith("cuda") else got


def _judged_call(plan: _Plan, workers: LabWorkers, job: dict[str, Any], ci: int, made: Made, name: str, against: str,
                 precision: str, truth: dict[str, torch.Tensor], expected: dict[str, torch.dtype], tol: Tolerance,
                 timeout_s: float) -> tuple[list[CheckResult], dict[str, torch.Tensor] | None, CandidateFault | None]:
    case = plan.cases[ci]
    try:
        # Keyed by what the inputs are: both checks of a bench share the candidate worker.
        key = ("case", shape_label(case.shape), str(case.dtype), case.seed)
        got = call_candidate(workers.candidate, job, key, made, case.device, name, precision, timeout_s)
    except CandidateFault as fault:
        failed = case.result(name, against, precision, "*", "failed", message=fault.message, tolerance=tol.describe(),
                             fault=fault.fault)
        return [failed], None, fault
    results, kept = judge_outputs(case, name, against, precision, got, truth, expected, tol)
    return results, kept, None


def _check_isolated(plan: _Plan, workers: LabWorkers, timeout_s: float) -> CheckReport:
    """Run the plan across ``workers``, ``timeout_s`` per call, judging here."""
    report = plan.report
    spec = plan.cases[0].spec if plan.cases else None
    if spec is None or not plan.precisions:
        return report
    job = {**workers.job_for(spec), "op": "make"}  # NotIsolatable before anything ran
    report.timeout_s = timeout_s
    plan.tick()
    for ci, case in enumerate(plan.cases):
        made = make_case(workers, job, case, plan.precisions, timeout_s)
        assert made.truth is not None and made.expected is not None
        truth = to_device(made.truth, case.device) if case.device.startswith("cuda") else made.truth
        shaped = [v for v in plan.variants if v.supports(case.shape)]
        for precision in plan.precisions:
            results, kernel_out, fault = _judged_call(plan, workers, job, ci, made, KERNEL, "reference", precision, truth,
                                                      made.expected[precision], spec.tolerance(precision), timeout_s)
            plan.record(results)
            for v in shaped:
                tol = spec.partition_tolerance(v, precision)
                if kernel_out is None:
                    msg = (f"the unpartitioned kernel {fault.message} on this input; nothing to compare against"
                           if fault is not None and fault.fault != "raised"
                           else "unpartitioned kernel failed on this input; nothing to compare against")
                    plan.record([case.result(v.name, KERNEL, precision, "*", "skipped", message=msg, tolerance=tol.describe())])
                    continue
                # The variant must reproduce the unpartitioned result, in its dtypes.
                dtypes = {n: t.dtype for n, t in kernel_out.items()}
                results, _, _ = _judged_call(plan, workers, job, ci, made, v.name, KERNEL, precision, kernel_out, dtypes,
                                             tol, timeout_s)
                plan.record(results)
    return report
