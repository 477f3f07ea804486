"""What a Python stack is waiting in: a lock, a queue, a socket, a sleep, a subprocess.

A py-spy dump gives each thread's Python frames, innermost last, and whether it owns
the GIL and is on a CPU.  A thread that neither owns the GIL nor runs is parked
somewhere; this module says where, from the frames alone, so that it works on any
Python server (ours with spans, or one we did not write):

- **Library frames.**  Blocking calls written in Python leave their own frames:
  ``Condition.wait`` in ``threading.py``, ``Queue.get`` in ``queue.py``,
  ``EpollSelector.select`` in ``selectors.py``, ``Popen.wait`` in ``subprocess.py``.
  Walking out from the innermost frame through such library frames, the *outermost*
  one that is a known blocking call names the kind (``Queue.get`` waits in
  ``Condition.wait``: the kind is ``queue``, not ``lock``).
- **The source line.**  Calls into C (``time.sleep``, ``lock.acquire``, a raw
  ``sock.recv``, ``SimpleQueue.get``) leave no frame: the innermost frame is their
  caller, stopped on the line that calls them.  That line, read from the file the
  frame names (the sampled process runs on this machine), says which call it is.  A
  line that awaits, and asyncio's own lines (its sockets never block), are no such call.

The **call site** is the frame a person would change: the first frame outside the
library chain (the handler that called ``Queue.get``), else the caller of the
blocking function.

Two waits are a thread's normal rest, not a stall:

- an asyncio event loop waiting in its selector (``selectors.select`` straight under
  ``BaseEventLoop._run_once``; a loop written in C, uvloop, waits below its ``run``
  call, which is then the innermost Python frame);
- a worker waiting for its next piece of work at its outer loop: a queue get, a
  receive or a select, a ``Condition``/``Event`` wait, called from the thread's target
  (the engine loop's ``self._wake.wait()``, a pool worker's ``work_queue.get()``).
"""

from __future__ import annotations

import linecache
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infra_agent.trace.model import Frame

LOCK, QUEUE, SOCKET, SLEEP, SUBPROCESS, OTHER = "lock", "queue", "socket", "sleep", "subprocess", "other"
KINDS = (LOCK, QUEUE, SOCKET, SLEEP, SUBPROCESS, OTHER)

ReadLine = Callable[[str, int], str]

# (path ending, {function: (kind, waits for work)}).  "Waits for work": a call that a
# thread makes at its outer loop to be given something to do (its rest, not a stall).
_SOCKET_IN = {n: (SOCKET, True) for n in ("recv", "recv_into", "recvfrom", "recvfrom_into", "recvmsg", "readinto",
                                          "accept", "read", "poll", "_poll", "wait", "recv_bytes", "_recv",
                                          "_recv_bytes", "recv_multipart", "recv_pyobj", "recv_json", "recv_string")}
_SOCKET_OUT = {n: (SOCKET, False) for n in ("send", "sendall", "sendto", "sendmsg", "write", "connect",
                                            "create_connection", "do_handshake", "send_bytes", "_send",
                                            "_send_bytes", "send_multipart", "send_pyobj", "send_json", "send_string")}
_SUBPROCESS = {n: (SUBPROCESS, False) for n in ("wait", "_wait", "_try_wait", "communicate", "_communicate", "run",
                                                 "call", "check_call", "check_output")}
_LIBRARY: tuple[tuple[str, dict[str, tuple[str, bool]]], ...] = (
    ("/threading.py", {"wait": (LOCK, True), "acquire": (LOCK, False), "__enter__": (LOCK, False),
                       "join": (LOCK, False), "_wait_for_tstate_lock": (LOCK, False)}),
    ("/queue.py", {"get": (QUEUE, True), "put": (QUEUE, False), "join": (QUEUE, False)}),
    ("/multiprocessing/queues.py", {"get": (QUEUE, True), "put": (QUEUE, False)}),
    ("/multiprocessing/connection.py", {**_SOCKET_IN, **_SOCKET_OUT}),
    ("/selectors.py", {"select": (SOCKET, True)}),
    ("/socket.py", {**_SOCKET_IN, **_SOCKET_OUT}),
    ("/ssl.py", {**_SOCKET_IN, **_SOCKET_OUT}),
    ("/zmq/sugar/socket.py", {**_SOCKET_IN, **_SOCKET_OUT}),
    ("/zmq/sugar/poll.py", {"poll": (SOCKET, True)}),
    ("/subprocess.py", _SUBPROCESS),
    ("/concurrent/futures/_base.py", {"result": (LOCK, False), "exception": (LOCK, False), "wait": (LOCK, False),
                                      "as_completed": (LOCK, False)}),
    ("/asyncio/tasks.py", {"sleep": (SLEEP, False)}),
)
# Frames of these modules are the plumbing between a call site and the wait itself.
_LIBRARY_PATHS = tuple(p for p, _ in _LIBRARY) + ("/asyncio/", "/concurrent/futures/", "/multiprocessing/", "/zmq/")
_BOOTSTRAP = ("_bootstrap", "_bootstrap_inner", "run")  # threading.Thread's own frames around a target

# The C calls a frame's source line may be stopped on: (pattern, kind, waits for work).
# The callee's dotted name is group 1.  A line that awaits runs a coroutine, which never
# blocks the thread: those are left alone.
_LINE_CALLS: tuple[tuple[re.Pattern[str], str, bool], ...] = (
    (re.compile(r"([\w.]*\bsleep)\s*\("), SLEEP, False),
    (re.compile(r"([\w.]*\.acquire)\s*\("), LOCK, False),
    # ``with self._wake:`` parked with no frame above it: a C ``__enter__``, a lock's acquire
    # (a context manager written in Python would show its own frame).
    (re.compile(r"^\s*with\s+([\w.]+)\s*(?::|,|\bas\b)"), LOCK, False),
    (re.compile(r"([\w.]*\.(?:recv\w*|accept|select|poll|epoll))\s*\("), SOCKET, True),
    (re.compile(r"\b(select\.select|select\.poll)\s*\("), SOCKET, True),
    (re.compile(r"([\w.]*\.(?:send\w*|connect))\s*\("), SOCKET, False),
    (re.compile(r"([\w.]*(?:queue|_q|\bq)\.get)\s*\(", re.I), QUEUE, True),
    (re.compile(r"([\w.]*(?:queue|_q|\bq)\.put)\s*\(", re.I), QUEUE, False),
    (re.compile(r"\b(os\.wait\w*|waitpid)\s*\("), SUBPROCESS, False),
)

_LOOP_ENTRY = (("/asyncio/base_events.py", ("run_forever", "run_until_complete", "_run_once")),
               ("/asyncio/runners.py", ("run",)),
               ("/uvloop/__init__.py", ("run",)))
# Where a loop written in C (uvloop) is entered: its selector wait is below these, with no
# Python frame above them.  asyncio's own loop always shows ``_run_once`` and its selector.
_C_LOOP_ENTRY = (("/asyncio/runners.py", ("run",)), ("/uvloop/__init__.py", ("run",)))


@dataclass(frozen=True)
class Blocking:
    """A thread parked in a call: what kind, in which function, and who called it."""

    kind: str  # one of KINDS
    waits_in: str  # the blocking function ("Queue.get") or the callee on the line ("time.sleep")
    site: Frame  # the call site: the frame to change
    for_work: bool  # a wait for input or a signal (get, receive, select, Condition/Event wait)
    outer: bool  # called from the thread's outer loop (its target), not from deeper code


def _norm(path: str) -> str:
    return "/" + path.replace("\\", "/").lstrip("/")


def _short(name: str) -> str:
    """py-spy names a method ``Class.method`` on Python 3.11+ and ``method`` before."""
    return name.rsplit(".", 1)[-1]


def is_library(frame: Frame) -> bool:
    path = _norm(frame.file)
    return any(p in path if p.endswith("/") else path.endswith(p) for p in _LIBRARY_PATHS)


def _known(frame: Frame) -> tuple[str, bool] | None:
    path = _norm(frame.file)
    for ending, funcs in _LIBRARY:
        if path.endswith(ending):
            return funcs.get(_short(frame.name))
    return None


def _is(frame: Frame, entries: tuple[tuple[str, tuple[str, ...]], ...]) -> bool:
    path = _norm(frame.file)
    return any(path.endswith(p) and _short(frame.name) in names for p, names in entries)


def runs_event_loop(frames: Sequence[Frame]) -> bool:
    """The stack runs an asyncio event loop (asyncio's own, or uvloop under asyncio.run)."""
    return any(_is(f, _LOOP_ENTRY) or "/uvloop/" in _norm(f.file) for f in frames)


def loop_waits_for_io(frames: Sequence[Frame]) -> bool:
    """An event loop idle in its selector: the normal rest of a loop thread, not a stall."""
    if not frames:
        return False
    leaf = frames[-1]
    if len(frames) >= 2 and _is(frames[-2], (("/asyncio/base_events.py", ("_run_once",)),)):
        return _short(leaf.name) in ("select", "poll", "_poll", "control")
    # A loop written in C waits below its run call: no Python frame above it.
    return _is(leaf, _C_LOOP_ENTRY) or "/uvloop/" in _norm(leaf.file)


def _outer(frames: Sequence[Frame], site_index: int) -> bool:
    """The call site is the thread's outermost code: a thread's target (``_loop``, a pool's
    ``_worker``), or for the main thread a script's ``<module>`` or the ``main`` under it."""
    started = any(_norm(f.file).endswith("/threading.py") and _short(f.name) in _BOOTSTRAP for f in frames[:site_index])
    own = [f for f in frames[:site_index] if not is_library(f)]
    return len(own) <= (0 if started else 1)


def _read_line(file: str, line: int) -> str:
    return linecache.getline(file, line)


def blocking_call(frames: Sequence[Frame], read_line: ReadLine | None = None) -> Blocking | None:
    """The call a parked stack (innermost frame last) waits in, or None when none is known."""
    if not frames:
        return None
    matched: tuple[int, str, bool] | None = None  # the outermost known call of the chain: index, kind, for work
    i = len(frames) - 1
    while i >= 0 and is_library(frames[i]):
        known = _known(frames[i])
        if known is not None:
            matched = (i, *known)
        i -= 1
    if matched is not None:
        at, kind, for_work = matched
        site_index = i if i >= 0 else max(at - 1, 0)  # all library (a pool's worker): the call's caller
        return Blocking(kind, frames[at].name, frames[site_index], for_work, _outer(frames, site_index))
    leaf = frames[-1]
    # asyncio's transports call send/recv on non-blocking sockets: parked on such a line, the
    # thread is in the syscall's copy or re-taking the GIL, never waiting on the peer.
    if leaf.line is None or "/asyncio/" in _norm(leaf.file):
        return None
    text = (read_line or _read_line)(leaf.file, leaf.line)
    if not text or "await " in text:
        return None
    for pattern, kind, for_work in _LINE_CALLS:
        m = pattern.search(text)
        if m:
            return Blocking(kind, m.group(1), leaf, for_work, _outer(frames, len(frames) - 1))
    return None
