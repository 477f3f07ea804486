"""The KV store: a put/get service of pages keyed by request id (Mooncake's role).

A process of its own (``serve_forever`` is its target), reached over a Unix socket.
Every message is one frame, ``op (1 byte) | id length (u16) | payload length (u32) |
id | payload`` (little-endian):

- ``PUT`` appends the payload (one page) to the request's pages;
- ``PUT_MANY`` appends several: the payload is ``u32 count`` then ``u32 length | page``
  per page (a batch put: one message, so one socket write on the sender's side, per
  batch);
- ``SEAL`` marks the request complete: a ``GET`` waiting for it returns;
- ``GET`` waits until the request is sealed (``GET_TIMEOUT_S`` at most), answers
  ``u32 count | u64 bytes`` then each page as ``u32 length | bytes``, and forgets the
  request; a request not sealed in time answers ``count = 0xFFFFFFFF``;
- ``DROP`` forgets a request (its pages are never fetched: the client went away).

The store keeps each message's framed pages as it received them and answers a ``GET``
with their concatenation: it never walks the pages, as a real KV store moves registered
memory without the host touching each block.  The reader checks the framing.  (On this
2-core box the store shares the cores with the prefill worker being measured, so its
per-page work would be charged to the transfer.)

Each client connection is served by a thread; one connection is used by one thread
of the client at a time (``KVStoreClient`` is not shared).  The store lives as long
as its parent: it exits when the parent process dies (``PR_SET_PDEATHSIG``) or on
SIGTERM, and removes its socket.
"""

from __future__ import annotations

import os
import signal
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from refstack.disagg.proc import die_with_parent, set_process_name

PUT, SEAL, GET, DROP, PUT_MANY = 1, 2, 3, 4, 5
_HEADER = struct.Struct("<BHI")
_U32 = struct.Struct("<I")
_ANSWER = struct.Struct("<IQ")
GET_TIMEOUT_S = 60.0
MISSING = 0xFFFFFFFF


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("KV store connection closed")
        got += k
    return bytes(buf)


class _Pages:
    __slots__ = ("blobs", "count", "sealed")

    def __init__(self) -> None:
        self.blobs: list[bytes | memoryview] = []  # framed pages (u32 length | page)...
        self.count = 0
        self.sealed = False


class _Store:
    def __init__(self) -> None:
        self.entries: dict[str, _Pages] = {}
        self.cond = threading.Condition()

    def put(self, rid: str, page: bytes) -> None:
        with self.cond:
            entry = self.entries.setdefault(rid, _Pages())
            entry.blobs += (_U32.pack(len(page)), page)
            entry.count += 1

    def put_many(self, rid: str, payload: bytes) -> None:
        if len(payload) < 4:
            raise ConnectionError(f"PUT_MANY for {rid}: {len(payload)} bytes, no page count")
        (count,) = _U32.unpack_from(payload)
        with self.cond:
            entry = self.entries.setdefault(rid, _Pages())
            entry.blobs.append(memoryview(payload)[4:])
            entry.count += count

    def seal(self, rid: str) -> None:
        with self.cond:
            self.entries.setdefault(rid, _Pages()).sealed = True
            self.cond.notify_all()

    def get(self, rid: str, timeout: float) -> _Pages | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (rid in self.entries and self.entries[rid].sealed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.entries.pop(rid)

    def drop(self, rid: str) -> None:
        with self.cond:
            self.entries.pop(rid, None)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        store: _Store = self.server.store  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        try:
            while True:
                op, id_len, n = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
                rid = _recv_exact(sock, id_len).decode()
                payload = _recv_exact(sock, n) if n else b""
                if op == PUT:
                    store.put(rid, payload)
                elif op == PUT_MANY:
                    store.put_many(rid, payload)
                elif op == SEAL:
                    store.seal(rid)
                elif op == DROP:
                    store.drop(rid)
                elif op == GET:
                    entry = store.get(rid, GET_TIMEOUT_S)
                    if entry is None:
                        sock.sendall(_ANSWER.pack(MISSING, 0))
                        continue
                    body = b"".join(entry.blobs)
                    sock.sendall(_ANSWER.pack(entry.count, len(body)))
                    sock.sendall(body)
                else:
                    return  # a confused client: drop the connection
        except (ConnectionError, OSError):
            return


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str) -> None:
        super().__init__(path, _Handler)
        self.store = _Store()


def serve_forever(path: str, ready: Any) -> None:
    """The store process's target: listen on ``path``, say so on ``ready`` (a Connection)."""
    die_with_parent()
    set_process_name("kv-store")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    server = _Server(path)

    def stop(*_: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    ready.send(("ready", os.getpid()))
    ready.close()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        try:
            os.unlink(path)
        except OSError:
            pass


class KVStoreClient:
    """One connection to the store; use it from one thread at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        # GET answers are read through a buffer: one recv per ~1 MiB, not two per page
        self._rfile = self.sock.makefile("rb", buffering=1 << 20)

    def _send(self, op: int, rid: str, payload: bytes | memoryview = b"") -> None:
        key = rid.encode()
        header = _HEADER.pack(op, len(key), len(payload))
        if len(payload) <= 65536:
            self.sock.sendall(header + key + payload)
        else:  # a bulk message: no concatenated copy of it
            self.sock.sendall(header + key)
            self.sock.sendall(payload)

    def put(self, rid: str, page: bytes | memoryview) -> None:
        self._send(PUT, rid, page)

    def put_many(self, rid: str, pages: Sequence[bytes]) -> None:
        """Several pages in one message (one ``sendall``)."""
        payload = _U32.pack(len(pages)) + b"".join(_U32.pack(len(p)) + p for p in pages)
        key = rid.encode()
        self.sock.sendall(_HEADER.pack(PUT_MANY, len(key), len(payload)) + key + payload)

    def seal(self, rid: str) -> None:
        self._send(SEAL, rid)

    def drop(self, rid: str) -> None:
        self._send(DROP, rid)

    def get(self, rid: str) -> list[memoryview] | None:
        """The request's pages in put order, once sealed; None if not sealed in time.

        One read of the whole answer, then a view per page (no copy per page); a framing
        that does not add up (a torn batch) is a ``ConnectionError`` naming the page."""
        self._send(GET, rid)
        count, size = _ANSWER.unpack(self._read(_ANSWER.size))
        if count == MISSING:
            return None
        body = memoryview(self._read(size))
        pages, off = [], 0
        for i in range(count):
            if off + 4 > size:
                raise ConnectionError(f"KV store answer for {rid}: page {i} of {count} starts past its {size} bytes")
            (n,) = _U32.unpack_from(body, off)
            if off + 4 + n > size:
                raise ConnectionError(f"KV store answer for {rid}: page {i} ({n} bytes) runs past its {size} bytes")
            pages.append(body[off + 4 : off + 4 + n])
            off += 4 + n
        if off != size:
            raise ConnectionError(f"KV store answer for {rid}: {size - off} bytes after its {count} pages")
        return pages

    def _read(self, n: int) -> bytes:
        data = self._rfile.read(n)
        if len(data) != n:
            raise ConnectionError("KV store connection closed")
        return data

    def close(self) -> None:
        self._rfile.close()
        self.sock.close()
