"""Running py-spy next to a target, and degrading to spans-only when it cannot attach.

py-spy needs ptrace on the target (root, ``CAP_SYS_PTRACE``, or
``kernel.yama.ptrace_scope`` 0).  When it is refused, or py-spy is not installed, a
probe still has the spans: :meth:`PySpyRecorder.stop` returns no file and a warning,
and :func:`infra_agent.trace.load.load_timeline` is called without ``pyspy``.

The start time is read when py-spy prints "Sampling process": that is the zero of
its chrometrace ``ts`` to within the time py-spy takes to print, far better than
the file-mtime estimate (see clock.py).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PTRACE_HINT = "py-spy could not attach (ptrace refused?): run as root or grant CAP_SYS_PTRACE"
# PySpyDumpSampler: consecutive failed dumps that end sampling, before any dump succeeded
# (refused, or no such process) and after one did (the target most likely exited).
GIVE_UP_BEFORE_FIRST_SAMPLE = 5
GIVE_UP_AFTER_SAMPLES = 50
MAX_KEPT_ERRORS = 20  # the first failures' messages; ``failures`` counts them all


@dataclass
class PySpyResult:
    path: Path | None  # None: no recording, analyse spans only
    start_unix_ns: int | None
    warning: str | None = None
    log: list[str] = field(default_factory=list)
    # How well ``start_unix_ns`` is known: py-spy's own zero lies between its launch and the moment
    # its "Sampling process" line was read, which on a loaded machine can be a few hundred ms apart.
    start_uncertainty_ns: int | None = None


def _first_line(text: str) -> str:
    """py-spy errors come with a Rust backtrace; the first line says what happened."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


class PySpyRecorder:
    """``py-spy record --format chrometrace --gil --idle`` on a pid, until :meth:`stop`.

    ``nonblocking``: read the target without pausing it (py-spy's ``--nonblocking``): a
    sample now and then reads a stack mid-change, but the target runs at its own pace, which
    matters at a few hundred Hz on a small machine."""

    def __init__(self, pid: int, out: str | Path, rate: int = 200, executable: str = "py-spy",
                 gil: bool = True, idle: bool = True, nonblocking: bool = False) -> None:
        self.pid, self.out, self.rate, self.gil, self.idle = pid, Path(out), rate, gil, idle
        self.nonblocking = nonblocking
        self.executable = executable
        self.proc: subprocess.Popen[str] | None = None
        self.start_unix_ns: int | None = None
        self.launch_unix_ns: int | None = None
        self.log: list[str] = []
        self._reader: threading.Thread | None = None
        self._error: str | None = None

    def start(self, wait_s: float = 10.0) -> PySpyRecorder:
        exe = shutil.which(self.executable)
        if exe is None:
            self._error = f"py-spy not found ({self.executable!r} is not on PATH): pip install py-spy"
            return self
        cmd = [exe, "record", "--format", "chrometrace", "-r", str(self.rate), "-o", str(self.out),
               "--pid", str(self.pid), *(["--gil"] if self.gil else []), *(["--idle"] if self.idle else []),
               *(["--nonblocking"] if self.nonblocking else [])]
        self.launch_unix_ns = time.time_ns()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started = threading.Event()

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line.rstrip())
                if "Sampling process" in line and self.start_unix_ns is None:
                    self.start_unix_ns = time.time_ns()
                    started.set()
            started.set()

        self._reader = threading.Thread(target=read, name="py-spy-reader", daemon=True)
        self._reader.start()
        started.wait(wait_s)
        if self.proc.poll() is not None and self.start_unix_ns is None:
            self._error = f"{PTRACE_HINT}; py-spy exited with {self.proc.returncode}: {' | '.join(self.log[-3:])}"
        return self

    def stop(self, timeout_s: float = 30.0) -> PySpyResult:
        """SIGINT (py-spy then writes its file), wait, and say what came of it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        if self._error is None and (not self.out.exists() or self.out.stat().st_size == 0):
            rc = self.proc.returncode if self.proc is not None else None
            self._error = f"{PTRACE_HINT}; py-spy wrote no file (exit {rc}): {' | '.join(self.log[-3:])}"
        if self._error is not None:
            return PySpyResult(None, None, f"py-spy unavailable, spans only: {self._error}", self.log)
        uncertainty = (self.start_unix_ns - self.launch_unix_ns
                       if self.start_unix_ns is not None and self.launch_unix_ns is not None else None)
        return PySpyResult(self.out, self.start_unix_ns, None, self.log, uncertainty)


class PySpyDumpSampler:
    """Exact GIL holders, sampled slowly: ``py-spy dump --json --nonblocking`` in a loop.

    Why this exists: py-spy's chrometrace output merges consecutive samples of a
    thread, so a thread that holds the GIL with one unchanging stack (a native call
    spinning, case study B) leaves no event at all after the first.  A dump lists
    every thread with ``owns_gil``, ``active`` (idle = not active), its native thread
    id (our tracer's tid) and its stack, which is what the GIL attribution needs.
    Each dump costs ~0.1-0.2 s here, so the rate is a few Hz: shares over a window of
    seconds are unbiased estimates, single millisecond spans are not resolved.

    Writes JSON lines: ``{"ts_unix_ns": <midpoint of the dump>, "threads": [<dump>]}``.
    """

    def __init__(self, pid: int, out: str | Path, interval_s: float = 0.0, executable: str = "py-spy") -> None:
        self.pid, self.out, self.interval_s, self.executable = pid, Path(out), interval_s, executable
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        self.samples = 0
        self.failures = 0  # failed dumps, all of them (``errors`` keeps the first messages)

    def start(self) -> PySpyDumpSampler:
        exe = shutil.which(self.executable)
        if exe is None:
            self.errors.append(f"py-spy not found ({self.executable!r} is not on PATH): pip install py-spy")
            return self
        cmd = [exe, "dump", "--json", "--nonblocking", "--pid", str(self.pid)]

        def loop() -> None:
            import json

            failed = 0
            with open(self.out, "w") as fh:
                while True:  # one dump at least, so a refusal is seen even after an early stop()
                    t0 = time.time_ns()
                    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    t1 = time.time_ns()
                    if proc.returncode != 0:
                        # A dump of a running process fails now and then: --nonblocking reads
                        # memory that is changing ("Failed to get stack traces"), and a target
                        # busy in one native section can fail several dumps in a row.  Before
                        # any dump succeeded, a few in a row mean refused or gone; once one
                        # did, attaching works, so keep sampling (backing off a little) and
                        # give up only on a long run, a target that has most likely exited.
                        failed += 1
                        self.failures += 1
                        if len(self.errors) < MAX_KEPT_ERRORS:
                            self.errors.append(_first_line(proc.stderr) or f"py-spy dump exited with {proc.returncode}")
                        limit = GIVE_UP_BEFORE_FIRST_SAMPLE if self.samples == 0 else GIVE_UP_AFTER_SAMPLES
                        if failed >= limit or self._stop.wait(min(0.02 * failed, 0.5)):
                            return
                        continue
                    failed = 0
                    fh.write(json.dumps({"ts_unix_ns": (t0 + t1) // 2, "threads": json.loads(proc.stdout)}) + "\n")
                    fh.flush()
                    self.samples += 1
                    if self._stop.wait(self.interval_s):
                        return

        self._thread = threading.Thread(target=loop, name="py-spy-dump", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> PySpyResult:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.samples == 0:
            why = self.errors[0] if self.errors else "no sample taken"
            return PySpyResult(None, None, f"py-spy unavailable, spans only: {PTRACE_HINT}; {why}")
        return PySpyResult(self.out, None, None, self.errors)
