"""The candidate's side of a judged timing: calls run on command, on inputs it never saw.

The judge's clock measures each batch from its command to the answer
(:mod:`infra_agent.lab.judge_clock`), so what it times must be the whole work of the
batch.  Work can hide from that clock in three ways, each closed here or checked by the
judge afterwards:

- **started elsewhere** (another thread, another CUDA stream) and still running when the
  call returns: every batch ends with a device-wide synchronise (all streams), a copy of
  the last call's outputs (taken inside the timed batch, on the device, so work still
  running shows as a wrong output), and a look at the process's Python threads: one started since the
  timing began and still alive is refused;
- **deferred** (a lazy object computed when read): every timed call's outputs must be
  plain ``torch.Tensor`` objects; a subclass or another type is refused;
- **cached** across calls (the same input every call, so a cache keyed on it wins): each
  timed call gets the next input of a pool made on the pristine side with seeds the
  candidate has not seen, used once each where the pool is large enough.

Which batches' outputs the judge checks is said only after the batch ran (``keep``), so
the kernel cannot do the real work on the checked batches alone.

Commands (bytes; :mod:`infra_agent.lab.wire`): ``warm:K`` (K calls on the staged check
input, for warm-up and batch sizing), ``run:K:KEEP`` (K calls on the next pool inputs;
KEEP says whether the *previous* batch's outputs are kept for the judge),
``gpu:K:M:KEEP`` (a GPU spin long enough to cover K calls' launches, then M calls, for
the judge's cross-check of the GPU clock), and ``E:KEEP`` (end: the kept outputs go back).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from infra_agent.lab.check_calls import as_outputs
from infra_agent.lab.spec import KernelSpec
from infra_agent.lab.wire import END, RAN, pack, to_cpu


class Refused(Exception):
    """A timed batch the judge may not count; the message says why."""


def _plain(value: Any) -> None:
    """Raise ``Refused`` unless every tensor in ``value`` is a plain, already-computed ``torch.Tensor``."""
    if type(value) is torch.Tensor:
        return
    if isinstance(value, torch.Tensor):
        raise Refused(f"a timed call returned a {type(value).__name__} (a torch.Tensor subclass); timed calls must "
                      "return plain tensors, so that no work is deferred until the outputs are read")
    if isinstance(value, (tuple, list)):
        for v in value:
            _plain(v)
    elif isinstance(value, dict):
        for v in value.values():
            _plain(v)


class TimedCalls:
    """Run the judge's batches of calls of ``fn`` in the candidate's worker."""

    def __init__(self, spec: KernelSpec, fn: Callable[..., Any], staged: dict[str, Any], pool: list[dict[str, Any]],
                 precision: str, device: str, conn: Connection, host_s: float | None = None) -> None:
        self.spec, self.fn, self.staged, self.pool = spec, fn, staged, pool
        self.precision, self.device, self.conn = precision, device, conn
        self.gpu = device.startswith("cuda")
        self.host_s = host_s  # the host's time per call, for sizing a GPU spin
        self.used = 0  # pool inputs used so far
        self.pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self.kept: list[tuple[int, dict[str, torch.Tensor]]] = []
        # Threads alive now belong to the worker, torch or the kernel's module as imported;
        # one started from here on and alive after a batch is work the clock did not see.
        self.threads = {t.ident for t in threading.enumerate()}
        self.cycles_per_us: float | None = None

    def _sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)  # every stream of the device, not only the current one

    def _call(self, inputs: dict[str, Any]) -> Any:
        result = self.fn(**inputs, precision=self.precision)
        _plain(result)
        return result

    def _batch(self, calls: int) -> None:
        """``calls`` calls on the next pool inputs; the last one's outputs copied before the answer."""
        if calls < 1:
            self._sync()  # a GPU spin alone is timed to its end too
            return
        last = None
        for _ in range(calls):
            inputs = self.pool[self.used % len(self.pool)]
            self.used += 1
            last = (self.used - 1) % len(self.pool), inputs, self._call(inputs)
        self._sync()
        assert last is not None
        index, inputs, result = last
        picked = result if self.spec.outputs is None else self.spec.outputs(result, inputs)
        _plain(picked)
        # A copy on the device, taken now (work still running shows in it); it goes to the host
        # only at the end, so a GPU batch's time does not include a transfer to the host.
        self.pending = (index, {k: v.detach().clone() for k, v in as_outputs(picked).items()})

    def _spin(self, calls: int) -> None:
        """A GPU-side spin that outlasts the host's launches of ``calls`` calls."""
        from infra_agent.lab.timing import cycles_for, sleep_cycles_per_us

        if self.cycles_per_us is None:
            self.cycles_per_us = sleep_cycles_per_us()
        host_us = (self.host_s or 1e-4) * 1e6
        torch.cuda._sleep(cycles_for(1.5 * calls * host_us + 200.0, self.cycles_per_us))

    def _keep(self, flag: bytes) -> None:
        if flag == b"1" and self.pending is not None:
            self.kept.append(self.pending)
        self.pending = None

    def _stray_threads(self) -> None:
        stray = [t.name for t in threading.enumerate() if t.ident not in self.threads and t.is_alive()]
        if stray:
            raise Refused(f"the kernel left {len(stray)} thread(s) running after its timed calls returned "
                          f"({', '.join(stray[:5])}): work the judge's clock cannot see")

    def _run(self, command: bytes) -> None:
        kind, *args = command.split(b":")
        if kind == b"warm":
            for _ in range(int(args[0])):
                self._call(self.staged)
            self._sync()
        elif kind == b"run":
            self._keep(args[1])
            self._batch(int(args[0]))
        elif kind == b"gpu":
            self._keep(args[2])
            self._spin(int(args[0]))
            self._batch(int(args[1]))
        else:
            raise RuntimeError(f"unknown timing command {command[:40]!r}")
        self._stray_threads()

    def serve(self) -> None:
        """Answer the judge's commands until it ends the timing; a refused batch ends it at once."""
        self.conn.send_bytes(pack(("ready",)))
        while True:
            command = self.conn.recv_bytes()
            if command.split(b":")[0] == END:
                self._keep(command.split(b":")[1] if b":" in command else b"0")
                self.conn.send_bytes(pack(("outs", [(i, to_cpu(outs)) for i, outs in self.kept])))
                return
            try:
                self._run(command)
            except Refused as exc:
                self.conn.send_bytes(pack(("raised", f"refused while timing: {exc}")))
                return
            except Exception as exc:  # noqa: BLE001 - the kernel's fault, reported as such
                self.conn.send_bytes(pack(("raised", f"raised while timing: {type(exc).__name__}: {exc}")))
                return
            self.conn.send_bytes(RAN)
