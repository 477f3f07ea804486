"""Process plumbing shared by the disaggregated server's children."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux), so a
    killed server leaves no orphans; exits at once if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the front end's shutdown and the process group still reap us
    if os.getppid() == 1:
        os._exit(1)


def set_process_name(name: str) -> None:
    """Name this process in ``/proc/PID/comm`` (15 bytes at most), so a profiler or the
    timeline probe can pick the prefill worker out of the server's children by name."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the process keeps its interpreter's name
