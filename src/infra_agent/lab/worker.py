"""The lab's worker processes: a hung or crashing kernel is a result, and the judge
never runs the code it judges.

A Python thread cannot be stopped, so a kernel that never returns would hang the
lab, and one that calls ``os._exit`` or faults would take it down.  The lab therefore
runs a spec's calls in worker processes (``python -m infra_agent.lab.worker``, each
in a session of its own, CUDA-safe since nothing is forked) and waits at most
``timeout_s`` for each call.  When a call overruns, the worker's whole process group
is killed; when the worker dies, its exit status is the finding.  Either way the
parent records the call and starts a fresh worker for the calls after it.

``LabWorkers`` holds the two workers of one spec file (:mod:`infra_agent.lab.worker_side`
says what each does): the *pristine* one loads the file the lab loaded (inputs and
reference outputs), the *candidate* one loads the file from the tree under test
(kernel and variants only).  The normal path costs two process starts per spec file
(every spec of the file, and both checks of ``bench``, share them), not one per call.

A worker loads the spec file again by path and picks each spec by the name it was
loaded under; only data fields (shapes, seeds, tolerances ...) travel, so a spec whose
code was replaced after loading cannot be isolated (``NotIsolatable``).

Protocol (bytes over a socket pair; :mod:`infra_agent.lab.wire`): ``("load", {origin,
digest})`` -> ``("ready", pid)``; then jobs (``make``, ``stage``, ``call``, ``time``), each
answered by its messages or by ``("spec_error", message)`` / ``("error", traceback)``;
``None`` ends the worker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from infra_agent.errors import KernelSpecError
from infra_agent.lab.spec import CALLABLE_FIELDS, KernelSpec
from infra_agent.lab.wire import Garbled, pack_job, unpack_reply

# Seconds a fresh worker may take to import torch and load the spec file.
STARTUP_TIMEOUT_S = 120.0
# Fields that do not travel to the worker: code (found in the file) and the source.
_NOT_DATA = frozenset(CALLABLE_FIELDS) | {"variants", "source"}


class NotIsolatable(Exception):
    """The spec cannot be loaded again in another process; the reason is the message."""


class WorkerTimeout(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds

    def describe(self) -> str:
        return f"did not return within {self.seconds:g} s (timeout_s); its worker process was killed"


class WorkerDied(Exception):
    def __init__(self, returncode: int | None) -> None:
        super().__init__(returncode)
        self.returncode = returncode

    def describe(self) -> str:
        code = self.returncode
        if code is not None and code < 0:
            try:
                status = f"killed by signal {signal.Signals(-code).name}"
            except ValueError:
                status = f"killed by signal {-code}"
        else:
            status = f"exit code {code}"
        return f"crashed its worker process ({status})"


def _data_fields(spec: KernelSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in _NOT_DATA}


def check_isolatable(spec: KernelSpec) -> None:
    """Raise ``NotIsolatable`` unless a worker can rebuild ``spec`` from its file."""
    src = spec.source
    if src is None or not spec.origin:
        raise NotIsolatable("the spec was built in code, not loaded from a spec file")
    for name in CALLABLE_FIELDS:
        if getattr(spec, name) is not src.callables.get(name):
            raise NotIsolatable(f"its {name} was replaced after loading")
    for v in spec.variants:
        if not any(v is o for o in src.variants):
            raise NotIsolatable(f"variant {v.name!r} was built after loading")
    try:
        pickle.dumps(_data_fields(spec))
    except Exception as exc:  # noqa: BLE001 - any pickling failure means it cannot travel
        raise NotIsolatable(f"its data fields cannot be sent to another process: {exc}") from None




class CheckWorker:
    """The parent's handle on one worker process (a context manager).

    ``role`` is ``"pristine"`` or ``"candidate"``; ``origin`` is the spec file it loads
    (default: the file ``spec`` came from) and ``cwd`` where it runs (default: here).
    ``send`` starts a worker when none is running; ``recv(timeout)`` waits at most that
    long for the next message; ``kill`` ends the worker's process group.  ``pids`` lists
    every worker started, for tests and diagnostics.  ``staged`` names the inputs the
    running worker holds (None after a restart).
    """

    def __init__(self, spec: KernelSpec, role: str = "candidate", *, origin: str | None = None, cwd: Path | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        check_isolatable(spec)
        assert spec.source is not None
        self.role = role
        self.origin = origin or spec.source.origin
        # A candidate's file is hashed, not loaded: the judge runs none of its code.
        self.digest = spec.source.digest if origin is None else hashlib.sha256(Path(origin).read_bytes()).hexdigest()
        self.cwd = cwd
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.pids: list[int] = []
        self.staged: Any = None
        self.busy = False  # a job was sent and its end not yet received

    def __enter__(self) -> CheckWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self) -> None:
        parent, child = multiprocessing.Pipe(duplex=True)
        fd = child.fileno()
        env = dict(os.environ)
        # The worker imports what this process imports, from the same places.
        paths = [p for p in sys.path if p]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cmd = [sys.executable, "-m", "infra_agent.lab.worker", str(fd), str(os.getpid()), self.role]
        try:
            # Its own session: one killpg ends it and anything its kernels started.
            # stdout goes to our stderr, so a kernel's prints cannot corrupt --json.
            proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=2, start_new_session=True,
                                    env=env, cwd=self.cwd)
        finally:
            child.close()
        self.proc, self.conn = proc, parent
        self.pids.append(proc.pid)
        self.staged = None
        try:
            parent.send_bytes(pack_job(("load", {"origin": self.origin, "digest": self.digest})))
            kind, *body = self._recv(self.startup_timeout_s)
        except WorkerTimeout:
            self.kill()
            raise KernelSpecError(f"{self.origin}: the {self.role} check worker did not start within {self.startup_timeout_s:g} s") from None
        except (WorkerDied, Garbled) as exc:
            self.kill()
            what = exc.describe() if isinstance(exc, WorkerDied) else f"sent an unreadable reply ({exc})"
            raise KernelSpecError(f"{self.origin}: the {self.role} check worker {what} while loading the spec (its error output is above)") from None
        if kind != "ready":
            self.kill()
            raise KernelSpecError(body[0] if kind == "spec_error" else f"{self.origin}: the {self.role} check worker failed to start:\n{body[0]}")

    def _recv_bytes(self, timeout: float) -> bytes:
        assert self.conn is not None and self.proc is not None
        try:
            if not self.conn.poll(timeout):
                raise WorkerTimeout(timeout)
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            raise WorkerDied(self.proc.wait()) from None

    def _recv(self, timeout: float) -> tuple[Any, ...]:
        return unpack_reply(self._recv_bytes(timeout), trusted=self.role == "pristine")

    def send(self, job: dict[str, Any]) -> None:
        """Send a job, starting a worker first when none is running."""
        if not self.alive:
            self.kill()
            self._spawn()
        self.send_raw(pack_job(job))
        self.busy = True

    def send_raw(self, data: bytes) -> None:
        assert self.conn is not None and self.proc is not None
        try:
            self.conn.send_bytes(data)
        except OSError:
            raise WorkerDied(self.proc.wait()) from None

    def recv_raw(self, timeout: float) -> bytes:
        """The next message's bytes, unread (the timing loop's one-byte answers)."""
        return self._recv_bytes(timeout)

    def recv(self, timeout: float) -> tuple[Any, ...]:
        """The next message; raises on a spec error, ``WorkerTimeout`` after ``timeout``
        seconds of silence, ``WorkerDied`` on exit, ``Garbled`` on bytes it cannot read."""
        kind, *body = self._recv(timeout)
        if kind == "spec_error":
            self.busy = False
            raise KernelSpecError(str(body[0]) if body else "the check worker reported a spec error")
        if kind == "error":
            self.busy = False
            raise RuntimeError(f"{self.origin}: the {self.role} check worker failed:\n{body[0] if body else ''}")
        return (kind, *body)

    def done(self) -> None:
        """The job's last message was read: the worker waits for the next job."""
        self.busy = False

    def kill(self) -> None:
        """End the worker and everything in its process group; reap it."""
        proc, conn = self.proc, self.conn
        self.proc = self.conn = None
        self.busy = False
        self.staged = None
        if conn is not None:
            conn.close()
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        """Ask an idle worker to exit, then end its process group in any case (at once
        when a job is still running, e.g. the run was interrupted)."""
        if self.proc is not None and self.conn is not None and not self.busy and self.proc.poll() is None:
            try:
                self.conn.send_bytes(pack_job(None))
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class LabWorkers:
    """The two workers of one spec file: pristine (inputs, reference) and candidate (kernel,
    variants).  ``candidate_origin``/``candidate_cwd`` name the candidate's copy of the file
    and its tree; without them the candidate loads the same file, still in a process of
    its own."""

    def __init__(self, spec: KernelSpec, candidate_origin: str | None = None, candidate_cwd: Path | None = None) -> None:
        self.pristine = CheckWorker(spec, "pristine")  # NotIsolatable for a spec not loaded from its file
        assert spec.source is not None
        self.source = (spec.source.origin, spec.source.digest)
        self.candidate = CheckWorker(spec, "candidate", origin=candidate_origin, cwd=candidate_cwd)

    def __enter__(self) -> LabWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return self.pristine.pids + self.candidate.pids

    def job_for(self, spec: KernelSpec) -> dict[str, Any]:
        """How a worker finds ``spec``: its name in the file and its data fields."""
        check_isolatable(spec)
        assert spec.source is not None
        if (spec.source.origin, spec.source.digest) != self.source:
            raise NotIsolatable(f"spec '{spec.name}' comes from another file than this worker's")
        return {"spec": spec.source.name, "overrides": _data_fields(spec)}

    def close(self) -> None:
        try:
            self.candidate.close()
        finally:
            self.pristine.close()


# ---- the worker side ----------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    # Killed along with its parent: no orphan keeps a GPU or a CPU busy.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    fd, parent_pid, role = int(args[0]), int(args[1]), args[2]
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from infra_agent.lab.worker_side import serve

    try:
        serve(Connection(fd), role)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: atexit hooks or a kernel's threads must not keep
        # a finished worker alive.
        os._exit(0)


if __name__ == "__main__":
    main()
