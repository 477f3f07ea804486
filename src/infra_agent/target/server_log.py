"""``ServerLog``: a launched server's output, written to its log file with its secrets masked.

The server writes into a pipe, and a reader thread writes what it reads to the file,
masked as everything else infra-agent writes (``safety.scrub_text`` with the launch's
secrets).  A file handed to the child would take the server's bytes to disk as printed,
and servers print secrets: their environment, or their arguments (vLLM lists its
non-default args, ``--api-key`` included).  The reader is apart from ``ServerProcess``
because it has its own life: it outlasts the server's exit, and it must never stall.

- The server never blocks on a full pipe: the thread reads whatever comes as soon as it
  comes, and goes on after the server crashed, until every writer (the server's children
  too) has closed the pipe.  A write to disk that fails loses that chunk, never the
  draining.
- Secrets are masked whole: a chunk is written up to its last newline and the rest waits
  for the end of its line, so a secret is not cut between two writes.  A line without
  its end is written anyway after ``quiet_s`` of silence (a prompt, a progress bar), at
  the end of the stream, or once it grows past ``_MAX_PARTIAL`` bytes.
- Bytes that are not UTF-8 reach the file unchanged (``surrogateescape``).
- The file is opened for appending: the lifeline writes its own line into the same file.
- ``settle()`` waits until what the server wrote so far is on disk, so the log tail of a
  server that has just exited holds its last lines; ``close()`` (after the server's group
  is stopped) reads to the end of the stream and closes the file.

When the launching process is killed the thread dies with it, and a server still running
then fails its writes (EPIPE): nothing is left to mask them.  The lifeline and the
parent-death signal stop such a server anyway (``orphan_guard.py``).
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import termios
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from infra_agent.safety import scrub_text

_CHUNK = 64 * 1024
_MAX_PARTIAL = 64 * 1024
_QUIET_S = 0.2
# How long the log tail of an exited server waits for its last lines, and how long a
# stop waits for the end of the stream (a process outside the group may hold the pipe).
_SETTLE_S = 2.0
_CLOSE_S = 5.0


def read_tail(path: Path, n: int) -> str:
    """The last ``n`` lines of a log file (from its last 64 KiB), unmasked: callers mask."""
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 64 * 1024))
        data = f.read().decode("utf-8", errors="replace")
    return "\n".join(data.splitlines()[-n:])


class ServerLog:
    """One log file: infra-agent's own notes, then the server's output, masked."""

    def __init__(self, path: Path, secrets: Sequence[str], *, quiet_s: float = _QUIET_S) -> None:
        self.path = path
        self._secrets = list(secrets)
        self._quiet_s = quiet_s  # how long a line without its end waits for it before it is written anyway
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        self._file = os.fdopen(fd, "wb", buffering=0)  # unbuffered: the tail is read from disk
        self._pipe: IO[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()  # every byte read so far is written, and the thread waits for more
        self._done = threading.Event()  # the stream has ended and the file is closed

    def note(self, text: str) -> None:
        """Write infra-agent's own lines (the argv, the cwd) before the server starts."""
        assert self._thread is None, "notes come before the server's output"
        self._write(text.encode("utf-8", errors="surrogateescape"))

    def follow(self, pipe: IO[bytes]) -> None:
        """Drain ``pipe`` (the server's stdout and stderr) into the file, on a thread of its own."""
        self._pipe = pipe
        self._thread = threading.Thread(target=self._drain, name=f"server-log:{self.path.name}", daemon=True)
        self._thread.start()

    def settle(self, timeout_s: float = _SETTLE_S) -> None:
        """Wait (up to ``timeout_s``) until all the server has written so far is in the file."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout_s
        while not self._done.is_set() and time.monotonic() < deadline:
            # The pipe first, then the flag: the thread clears the flag before it reads,
            # so an empty pipe and a set flag mean nothing read is still unwritten.
            if self._unread() == 0 and self._idle.is_set():
                return
            time.sleep(0.01)

    def close(self, timeout_s: float = _CLOSE_S) -> None:
        """Write the rest of the stream and close the file; call it once the server's group is gone.

        A process that left the group may still hold the pipe: then the thread goes on
        draining it and closes the file itself when the stream ends.
        """
        if self._thread is None:
            self._file.close()
            self._done.set()
            return
        self._thread.join(timeout_s)

    # ------------------------------------------------------------ the thread

    def _drain(self) -> None:
        assert self._pipe is not None
        fd = self._pipe.fileno()
        poller = select.poll()  # not select(): a descriptor above 1023 is out of its range
        poller.register(fd, select.POLLIN)
        partial = b""
        try:
            while True:
                if not partial:
                    self._idle.set()
                ready = poller.poll(self._quiet_s * 1000 if partial else None)
                self._idle.clear()
                if not ready:  # quiet: the line without its end is all there is for now
                    self._write(partial)
                    partial = b""
                    continue
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    break
                partial += chunk
                cut = partial.rfind(b"\n") + 1
                if cut == 0 and len(partial) >= _MAX_PARTIAL:
                    cut = len(partial)
                if cut:
                    self._write(partial[:cut])
                    partial = partial[cut:]
            self._write(partial)
        finally:
            self._pipe.close()
            self._file.close()
            self._done.set()

    def _write(self, data: bytes) -> None:
        if not data:
            return
        text = data.decode("utf-8", errors="surrogateescape")
        out = memoryview(scrub_text(text, self._secrets).encode("utf-8", errors="surrogateescape"))
        try:
            while out:  # a raw write may take part of it
                out = out[self._file.write(out):]
        except OSError:
            pass  # a full disk loses these lines; the server must still never block on its pipe

    def _unread(self) -> int:
        """Bytes waiting in the pipe (0 once it is closed)."""
        assert self._pipe is not None
        try:
            raw = fcntl.ioctl(self._pipe.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):  # closed by the thread at the end of the stream
            return 0
        return int(struct.unpack("i", raw)[0])
