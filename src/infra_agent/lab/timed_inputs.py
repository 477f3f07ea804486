"""The inputs of a judged timing, and the check of what the timed calls returned.

Timing every call on one input lets a kernel win by remembering: a cache keyed on the
input (its address, or a few of its elements) answers every call after the first at
once.  So the timed calls run on a **pool** of inputs that the pristine worker makes
with fresh seeds (none of them the check's, and none the candidate has seen before the
timing starts), each call on the next one.  The pool is bounded (``POOL_BYTES``, at most
``MAX_POOL`` inputs): where it holds fewer inputs than the timing needs calls, the judge
shortens its batches, and only inputs too large for ten of them to fit are used more
than once (the timing's notes say so).

After the timing, the outputs the candidate's worker copied at the end of a few batches
(which ones, the judge said only after each batch had run) are compared with the
reference's outputs on the same inputs, computed by the pristine worker.  A kernel that
returned before its work ended, cached an answer, or computes only the inputs it saw
in the check is refused there.
"""

from __future__ import annotations

from typing import Any

import torch

from infra_agent.lab.check_calls import _Case, judge_outputs
from infra_agent.lab.check_isolated import make_case
from infra_agent.lab.correctness import draw_seeds
from infra_agent.lab.loader import spec_error
from infra_agent.lab.spec import KERNEL, Tolerance
from infra_agent.lab.wire import Garbled, tensors_by_name, to_device
from infra_agent.lab.worker import LabWorkers, WorkerDied, WorkerTimeout

POOL_BYTES = 64 * 2**20
MAX_POOL = 2048
MIN_POOL = 2


def input_bytes(value: Any) -> int:
    """The bytes of every tensor in ``value`` (dicts, lists and tuples followed)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(input_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(input_bytes(v) for v in value)
    return 0


def pool_size(nbytes: int) -> int:
    """How many inputs of ``nbytes`` bytes the pool holds."""
    return max(MIN_POOL, min(MAX_POOL, POOL_BYTES // max(nbytes, 1)))


def make_pool(workers: LabWorkers, job: dict[str, Any], case: _Case, n: int,
              timeout_s: float) -> tuple[list[int], list[dict[str, Any]]]:
    """``n`` inputs made by the pristine worker and staged in the candidate's; returns their seeds and
    the judge's copy of them (the reference of a checked call is computed on that copy)."""
    taken = {case.seed, *(case.spec.seeds or [])}
    seeds = [s for s in draw_seeds(n + len(taken)) if s not in taken][:n]
    pristine = workers.pristine
    try:
        pristine.send({**job, "op": "pool", "seeds": seeds, "shape": case.shape, "dtype": case.dtype,
                       "device": case.device})
        kind, *body = pristine.recv(timeout_s * 4 + 60)
        if kind != "pool" or len(body) != 1 or len(body[0]) != n:
            raise Garbled(f"unexpected message {kind!r}")
        pristine.done()
    except (WorkerTimeout, WorkerDied, Garbled) as exc:
        pristine.kill()
        what = exc.describe() if isinstance(exc, (WorkerTimeout, WorkerDied)) else f"sent an unreadable reply ({exc})"
        raise spec_error(case.spec, "input factory", f"the pristine check worker {what} making the timed inputs "
                                                     f"[{case.input_label()}]") from None
    candidate = workers.candidate
    candidate.send({**job, "op": "stage_pool", "pool": body[0], "device": case.device})
    kind, *_ = candidate.recv(timeout_s * 4 + 60)
    if kind != "staged":
        raise Garbled(f"unexpected message {kind!r}")
    candidate.done()
    return seeds, body[0]


def read_kept(body: list[Any], n: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """The outputs the candidate kept, as ``(pool index, named tensors)``, checked field by field."""
    kept = body[0] if len(body) == 1 else None
    if not isinstance(kept, list) or not all(isinstance(k, tuple) and len(k) == 2 for k in kept):
        raise Garbled("the kept outputs must be a list of (index, outputs) pairs")
    out = []
    for index, outputs in kept:
        if not (isinstance(index, int) and 0 <= index < n):
            raise Garbled(f"a kept output names pool input {index!r}, not one of the {n} staged")
        out.append((index, tensors_by_name(outputs)))
    return out


def _summed(a: Tolerance, b: Tolerance) -> Tolerance:
    """The bound for a variant against the reference: its own bound against the kernel plus the
    kernel's against the reference (the triangle inequality), on the criteria both set."""
    fields = {f: getattr(a, f) + getattr(b, f) for f in ("atol", "rtol", "rel_fro", "ulp")
              if getattr(a, f) is not None and getattr(b, f) is not None}
    return Tolerance(**fields, ulp_floor=a.ulp_floor) if fields else a


def tolerance_for(case: _Case, variant: str, precision: str) -> Tolerance:
    spec = case.spec
    tol = spec.tolerance(precision)
    return tol if variant == KERNEL else _summed(spec.partition_tolerance(spec.variant(variant), precision), tol)


def check_kept(workers: LabWorkers, job: dict[str, Any], case: _Case, pool: tuple[list[int], list[dict[str, Any]]],
               kept: list[Any], variant: str, precision: str, timeout_s: float) -> str | None:
    """Why a timed call's kept outputs do not match the reference on its input, or None."""
    if not kept:
        return "no timed call's outputs came back to be checked"
    tol = tolerance_for(case, variant, precision)
    seeds, inputs = pool
    for index, got in kept:
        on = _Case(case.spec, case.shape, case.dtype, seeds[index], case.device)
        made = make_case(workers, {**job, "op": "reference", "inputs": inputs[index]}, on, [precision], timeout_s)
        assert made.truth is not None and made.expected is not None
        truth = to_device(made.truth, case.device) if case.device.startswith("cuda") else made.truth
        got = to_device(got, case.device) if case.device.startswith("cuda") else got
        results, _ = judge_outputs(on, variant, "reference", precision, got, truth, made.expected[precision], tol)
        failed = [r for r in results if r.status == "failed"]
        if failed:
            return (f"refused: the output of a timed call does not match the reference on its input "
                    f"({failed[0].output}: {failed[0].message}; {on.input_label()}): work done after the call "
                    f"returned, a cached answer, or a kernel right only on the inputs it was checked on")
    return None
