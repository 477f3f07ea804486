"""A worker process for kernel checks, so that a hung or crashing kernel is a result.

A Python thread cannot be stopped, so a kernel that never returns would hang the
lab, and one that calls ``os._exit`` or faults would take it down.  The lab therefore
runs a spec's checks in a worker process (``python -m infra_agent.lab.worker``,
in a session of its own, CUDA-safe since nothing is forked) and waits at most
``timeout_s`` for each call.  When a call overruns, the worker's whole process group
is killed; when the worker dies, its exit status is the finding.  Either way the
parent (:func:`infra_agent.lab.correctness.check_spec`) records the call and
starts a fresh worker for the calls after it.  The normal path costs one process
start per spec file (every spec of the file, and both checks of ``bench``, share the
worker), not one per call.

The worker loads the spec file again by path and picks each spec by the name it was
loaded under; only data fields (shapes, seeds, tolerances ...) travel, so a spec whose
code was replaced after loading cannot be isolated (``NotIsolatable``).

Protocol (pickled tuples over a socket pair; parent -> worker first):
``("load", {origin, digest})`` -> ``("ready", pid)``; then jobs
``{spec, overrides, variants, device, cases, precisions, done, no_baseline}`` answered by
``("begin", key, replay)`` before each step that runs spec code, ``("results", key,
[CheckResult])`` after each call, and ``("job_done",)``; ``("spec_error", message)`` and
``("error", traceback)`` end a job; ``None`` ends the worker.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from infra_agent.errors import KernelSpecError
from infra_agent.lab.spec import CALLABLE_FIELDS, KernelSpec

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
    """The parent's handle on the worker process of one spec file (a context manager).

    ``send`` starts a worker when none is running; ``recv(timeout)`` waits at most that
    long for the next message; ``kill`` ends the worker's process group.  ``pids``
    lists every worker started, for tests and diagnostics.  Built from any spec of the
    file; ``job_for`` checks that a spec can be rebuilt there.
    """

    def __init__(self, spec: KernelSpec, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        check_isolatable(spec)
        assert spec.source is not None
        self.origin = spec.source.origin
        self.digest = spec.source.digest
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.pids: list[int] = []
        self.busy = False  # a job was sent and its job_done not yet received

    def __enter__(self) -> CheckWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def job_for(self, spec: KernelSpec) -> dict[str, Any]:
        """How the worker finds ``spec``: its name in the file and its data fields."""
        check_isolatable(spec)
        assert spec.source is not None
        if (spec.source.origin, spec.source.digest) != (self.origin, self.digest):
            raise NotIsolatable(f"spec '{spec.name}' comes from another file than this worker's")
        return {"spec": spec.source.name, "overrides": _data_fields(spec)}

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _prefix(self) -> str:
        return self.origin

    def _spawn(self) -> None:
        parent, child = multiprocessing.Pipe(duplex=True)
        fd = child.fileno()
        env = dict(os.environ)
        # The worker imports what this process imports, from the same places.
        paths = [p for p in sys.path if p]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        cmd = [sys.executable, "-m", "infra_agent.lab.worker", str(fd), str(os.getpid())]
        try:
            # Its own session: one killpg ends it and anything its kernels started.
            # stdout goes to our stderr, so a kernel's prints cannot corrupt --json.
            proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=2, start_new_session=True, env=env)
        finally:
            child.close()
        self.proc, self.conn = proc, parent
        self.pids.append(proc.pid)
        try:
            parent.send(("load", {"origin": self.origin, "digest": self.digest}))
            kind, *body = self._recv(self.startup_timeout_s)
        except WorkerTimeout:
            self.kill()
            raise KernelSpecError(f"{self._prefix()}: the check worker did not start within {self.startup_timeout_s:g} s") from None
        except WorkerDied as exc:
            self.kill()
            raise KernelSpecError(f"{self._prefix()}: the check worker {exc.describe()} while loading the spec (its error output is above)") from None
        if kind != "ready":
            self.kill()
            raise KernelSpecError(body[0] if kind == "spec_error" else f"{self._prefix()}: the check worker failed to start:\n{body[0]}")

    def _recv(self, timeout: float) -> tuple[Any, ...]:
        assert self.conn is not None and self.proc is not None
        try:
            ready = self.conn.poll(timeout)
            if not ready:
                raise WorkerTimeout(timeout)
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerDied(self.proc.wait()) from None
        return msg  # type: ignore[no-any-return]

    def send(self, job: dict[str, Any]) -> None:
        """Send a job, starting a worker first when none is running."""
        if not self.alive:
            self.kill()
            self._spawn()
        assert self.conn is not None and self.proc is not None
        try:
            self.conn.send(job)
            self.busy = True
        except OSError:
            raise WorkerDied(self.proc.wait()) from None

    def recv(self, timeout: float) -> tuple[Any, ...]:
        """The next ``begin``/``results``/``job_done`` message; raises on a spec error,
        ``WorkerTimeout`` after ``timeout`` seconds of silence, ``WorkerDied`` on exit."""
        kind, *body = self._recv(timeout)
        if kind in ("job_done", "spec_error", "error"):
            self.busy = False
        if kind == "spec_error":
            raise KernelSpecError(body[0])
        if kind == "error":
            raise RuntimeError(f"{self._prefix()}: the check worker failed:\n{body[0]}")
        return (kind, *body)

    def kill(self) -> None:
        """End the worker and everything in its process group; reap it."""
        proc, conn = self.proc, self.conn
        self.proc = self.conn = None
        self.busy = False
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
                self.conn.send(None)
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


# ---- the worker side ----------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    # Killed along with its parent: no orphan keeps a GPU or a CPU busy.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def _load(request: dict[str, Any]) -> dict[str, KernelSpec]:
    import hashlib
    from pathlib import Path

    from infra_agent.lab.loader import load_specs

    origin = request["origin"]
    if hashlib.sha256(Path(origin).read_bytes()).hexdigest() != request["digest"]:
        raise KernelSpecError(f"{origin}: the spec file changed on disk during the run")
    return {s.name: s for s in load_specs(origin, check_inputs=False)}


def _serve(conn: Connection) -> None:
    try:
        _, request = conn.recv()
        loaded = _load(request)
    except KernelSpecError as exc:
        conn.send(("spec_error", str(exc)))
        return
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))

    from infra_agent.lab.check_calls import _Case, _run_case

    def begin(key: Any, replay: bool) -> None:
        conn.send(("begin", key, replay))

    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            base = loaded.get(job["spec"])
            if base is None:
                raise KernelSpecError(f"{request['origin']}: spec '{job['spec']}' was not found when loading the file again")
            spec = dataclasses.replace(base, **job["overrides"])
            variants = [base.variant(n) for n in job["variants"]]
            for ci, (shape, dtype, seed) in enumerate(job["cases"]):
                case = _Case(spec, shape, dtype, seed, job["device"])
                steps = _run_case(case, ci, job["precisions"], variants, begin=begin, done=job["done"], no_baseline=job["no_baseline"])
                for key, results in steps:
                    conn.send(("results", key, results))
            conn.send(("job_done",))
        except KernelSpecError as exc:
            conn.send(("spec_error", str(exc)))
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    fd, parent_pid = int(args[0]), int(args[1])
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        _serve(Connection(fd))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: atexit hooks or a kernel's threads must not keep
        # a finished worker alive.
        os._exit(0)


if __name__ == "__main__":
    main()
