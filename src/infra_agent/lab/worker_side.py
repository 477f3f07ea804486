"""Inside a kernel-lab worker process: the pristine side and the candidate side.

The judge (the lab's process) never runs the code it judges.  Two workers serve it:

- **pristine** loads the spec file from the tree under judgement's *parent* (the
  baseline commit in a run; the same file otherwise) and makes each case's inputs and
  the reference's outputs;
- **candidate** loads the spec file from the candidate's tree and only runs its kernel
  and variants, on copies of the pristine inputs, returning outputs (or, when timed,
  running calls while the judge's clock runs; see :mod:`infra_agent.lab.judge_clock`).

Neither compares anything: the lab's process compares the candidate's outputs with
reference outputs the candidate never saw (:mod:`infra_agent.lab.check_isolated`).
Replies go through :mod:`infra_agent.lab.wire`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from infra_agent.errors import KernelSpecError
from infra_agent.lab.check_calls import (
    _call_and_pick,
    _Case,
    _clone,
    _expected_dtypes,
    as_outputs,
)
from infra_agent.lab.loader import spec_error
from infra_agent.lab.spec import KERNEL, KernelSpec
from infra_agent.lab.wire import pack, to_cpu, to_device, unpack_job

Reply = Callable[[Any], None]


def _load(request: dict[str, Any]) -> dict[str, KernelSpec]:
    from infra_agent.lab.loader import load_specs

    origin = request["origin"]
    if hashlib.sha256(Path(origin).read_bytes()).hexdigest() != request["digest"]:
        raise KernelSpecError(f"{origin}: the spec file changed on disk during the run")
    return {s.name: s for s in load_specs(origin, check_inputs=False)}


def _spec(loaded: dict[str, KernelSpec], job: dict[str, Any], origin: str) -> KernelSpec:
    base = loaded.get(job["spec"])
    if base is None:
        raise KernelSpecError(f"{origin}: spec '{job['spec']}' was not found when loading the file again")
    return dataclasses.replace(base, **job["overrides"])


class _Pristine:
    """Inputs and reference outputs, from the pristine tree's spec file."""

    def __init__(self, loaded: dict[str, KernelSpec], origin: str, reply: Reply) -> None:
        self.loaded, self.origin, self.reply = loaded, origin, reply

    def run(self, job: dict[str, Any]) -> None:
        spec = _spec(self.loaded, job, self.origin)
        if job["op"] == "pool":
            self._pool(spec, job)
            return
        if job["op"] == "reference":
            self._reference_on(spec, job)
            return
        shape, dtype, seed, device = job["case"]
        case = _Case(spec, shape, dtype, seed, device)
        self.reply(("begin", "inputs"))
        try:
            inputs = spec.inputs(shape, dtype, seed, device)
        except Exception as exc:  # noqa: BLE001
            raise spec_error(spec, "input factory", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
        truth = expected = None
        if job.get("reference", True):
            self.reply(("begin", "reference"))
            try:
                assert spec.reference is not None
                truth = as_outputs(spec.reference(**_clone(inputs)))
            except Exception as exc:  # noqa: BLE001
                raise spec_error(spec, "reference", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
            expected = {p: _expected_dtypes(spec, dtype, p, list(truth)) for p in job["precisions"]}
        self.reply(("made", to_cpu(inputs), to_cpu(truth), expected))

    def _pool(self, spec: KernelSpec, job: dict[str, Any]) -> None:
        """Inputs for the timed calls, one per seed (none of them the check's)."""
        shape, dtype, device = job["shape"], job["dtype"], job["device"]
        pool = []
        for seed in job["seeds"]:
            try:
                pool.append(to_cpu(spec.inputs(shape, dtype, seed, device)))
            except Exception as exc:  # noqa: BLE001
                case = _Case(spec, shape, dtype, seed, device)
                raise spec_error(spec, "input factory", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
        self.reply(("pool", pool))

    def _reference_on(self, spec: KernelSpec, job: dict[str, Any]) -> None:
        """The reference's outputs on inputs the judge sends back (a timed call's, from the pool
        this worker made): the same bytes, even where the input factory is not deterministic."""
        shape, dtype, seed, device = job["case"]
        case = _Case(spec, shape, dtype, seed, device)
        self.reply(("begin", "reference"))
        try:
            assert spec.reference is not None
            truth = as_outputs(spec.reference(**_clone(to_device(job["inputs"], device))))
        except Exception as exc:  # noqa: BLE001
            raise spec_error(spec, "reference", f"raised {type(exc).__name__}: {exc} [{case.input_label()}]") from exc
        expected = {p: _expected_dtypes(spec, dtype, p, list(truth)) for p in job["precisions"]}
        self.reply(("made", None, to_cpu(truth), expected))


class _Candidate:
    """The candidate's kernel and variants on staged inputs: outputs or calls, never verdicts."""

    def __init__(self, loaded: dict[str, KernelSpec], origin: str, reply: Reply, conn: Connection) -> None:
        self.loaded, self.origin, self.reply, self.conn = loaded, origin, reply, conn
        self.staged: tuple[Any, dict[str, Any]] | None = None
        self.pool: list[dict[str, Any]] = []

    def _fn(self, spec: KernelSpec, name: str) -> Callable[..., Any]:
        if name == KERNEL:
            return spec.kernel
        try:
            return spec.variant(name).fn
        except KernelSpecError:
            raise spec_error(spec, None, f"the candidate's spec file declares no variant '{name}'", origin=self.origin) from None

    def run(self, job: dict[str, Any]) -> None:
        if job["op"] == "stage":
            self.staged = (job["key"], to_device(job["inputs"], job["device"]))
            self.reply(("staged",))
            return
        if job["op"] == "stage_pool":
            self.pool = to_device(job["pool"], job["device"])
            self.reply(("staged",))
            return
        spec = _spec(self.loaded, job, self.origin)
        fn = self._fn(spec, job["variant"])
        if self.staged is None or self.staged[0] != job["key"]:
            raise RuntimeError(f"inputs {job['key']!r} were not staged in this worker")
        inputs, device, precision = self.staged[1], job["device"], job["precision"]
        if job["op"] == "call":
            try:
                got = as_outputs(_call_and_pick(spec, fn, inputs, precision))
                if device.startswith("cuda"):
                    torch.cuda.synchronize()  # a kernel's fault surfaces here, inside the try
            except Exception as exc:  # noqa: BLE001 - a faulty kernel is a finding
                self.reply(("raised", f"raised {type(exc).__name__}: {exc}"))
                return
            self.reply(("out", to_cpu(got)))
        elif job["op"] == "time":
            self._time(spec, fn, inputs, precision, job)
        else:
            raise RuntimeError(f"unknown job {job['op']!r}")

    def _time(self, spec: KernelSpec, fn: Callable[..., Any], staged: dict[str, Any], precision: str,
              job: dict[str, Any]) -> None:
        """Timed calls: on the CPU the judge's clock times batches run on command; on a GPU the
        CUDA events time them here first, and then the judge's clock checks what they said."""
        from infra_agent.lab.timed_calls import TimedCalls

        device = job["device"]
        # Inputs are not cloned per call: an in-place kernel (a decode state) keeps
        # updating the same buffers, as it does in the engine.
        warm = _clone(staged)
        host_s = None
        if job["clock"] == "worker":
            from infra_agent.lab.timing import time_call

            try:
                torch.cuda.synchronize(device)
                t = time_call(lambda: fn(**warm, precision=precision), device, budget_s=job["budget_s"],
                              method=job["method"])
            except Exception as exc:  # noqa: BLE001 - the lab reports, it does not crash
                self.reply(("raised", f"raised while timing: {type(exc).__name__}: {exc}"))
                return
            host_s = t.host_median_s
            self.reply(("timing", {"samples_s": [float(s) for s in t.samples_s], "method": t.method, "warmup": t.warmup,
                                   "batch": t.batch, "notes": list(t.notes),
                                   "host_samples_s": None if t.host_samples_s is None else [float(s) for s in t.host_samples_s]}))
        TimedCalls(spec, fn, warm, self.pool, precision, device, self.conn, host_s).serve()


def serve(conn: Connection, role: str) -> None:
    """Answer the lab until it sends ``None`` or goes away."""

    def reply(message: Any) -> None:
        conn.send_bytes(pack(message))

    try:
        _, request = unpack_job(conn.recv_bytes())
        loaded = _load(request)
    except KernelSpecError as exc:
        reply(("spec_error", str(exc)))
        return
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        reply(("error", traceback.format_exc()))
        return
    reply(("ready", os.getpid()))
    origin = request["origin"]
    side = _Pristine(loaded, origin, reply) if role == "pristine" else _Candidate(loaded, origin, reply, conn)
    while True:
        try:
            job = unpack_job(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            side.run(job)
        except KernelSpecError as exc:
            reply(("spec_error", str(exc)))
        except Exception:  # noqa: BLE001
            reply(("error", traceback.format_exc()))
