"""What stops a server whose launcher dies without running any code (SIGKILL, an OOM kill, a crash).

``ServerProcess`` stops its server on every way out of Python code; these two cover the
ways out that run none, so they live apart from the launch and stop logic:

- **parent-death signal** (Linux, ``parent_death_preexec``): the server gets SIGTERM
  from the kernel when the thread that launched it exits (``prctl(PR_SET_PDEATHSIG)``).
  It is tied to the *thread*, not the process, so servers must be started from a thread
  that lives as long as they do.  It reaches only the direct child.
- **lifeline** (``Lifeline``): a small watchdog (``lifeline.py``) in its own session
  holds the read end of a pipe whose write end only the launcher holds; on EOF it stops
  the whole group, TERM then KILL.  It covers a shell's children and non-Linux systems.
  A child made with a bare ``os.fork()`` (no exec) inherits the write end and keeps the
  lifeline armed until it exits too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIFELINE_SCRIPT = Path(__file__).with_name("lifeline.py")


def parent_death_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGTERM the child when our thread exits.

    Everything is looked up before the fork: between fork and exec the child only
    makes one foreign call and one system call.  None where prctl does not exist.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    term = int(signal.SIGTERM)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, term, 0, 0, 0)
        if os.getppid() != parent:  # we died between fork and prctl: no signal will come
            os._exit(128 + term)

    return preexec


class Lifeline:
    """The watchdog process of one server group, armed while this process holds its pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], write_fd: int) -> None:
        self._proc: subprocess.Popen[bytes] | None = proc
        self._write_fd: int | None = write_fd  # write end of its pipe; only we hold it

    @classmethod
    def start(cls, pgid: int, grace_s: float, log_path: Path) -> Lifeline | None:
        """Arm a lifeline for group ``pgid``; its own lines go to ``log_path`` (appended).

        None when it cannot be started: the parent-death signal and ``stop()`` still cover the server.
        """
        read_fd, write_fd = os.pipe()  # both close-on-exec; Popen dup2s the read end to 0
        try:
            # Appending: the server's log writer appends to the same file, and neither may
            # overwrite the other's lines.
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_LIFELINE_SCRIPT), str(pgid), f"{grace_s:g}"],
                    stdin=read_fd,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,  # a signal to our group must not take it along
                )
        except OSError:
            os.close(write_fd)
            return None
        finally:
            os.close(read_fd)
        return cls(proc, write_fd)

    def disarm(self) -> None:
        """Tell the lifeline the launcher stops the server itself, and wait for it to end."""
        if self._write_fd is not None:
            try:
                os.write(self._write_fd, b"x")
            except OSError:
                pass
            os.close(self._write_fd)
            self._write_fd = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
