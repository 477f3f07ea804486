"""A correctness check run in a worker process, every call under a timeout.

The worker (:mod:`infra_agent.lab.worker`) runs the cases with the lab's own code
(:mod:`infra_agent.lab.check_calls`) and says which step it is starting, so when a
call overruns or takes the worker down the parent knows which call to record as
failed; a fresh worker then goes on with the calls after it.
"""

from __future__ import annotations

from infra_agent.lab.check_calls import StepKey, _Plan
from infra_agent.lab.check_report import CheckReport, Fault
from infra_agent.lab.loader import spec_error
from infra_agent.lab.spec import KERNEL
from infra_agent.lab.worker import CheckWorker, WorkerDied, WorkerTimeout


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
