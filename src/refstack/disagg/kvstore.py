"""The KV store: a put/get service of pages keyed by request id (Mooncake's role).

A process of its own (``serve_forever`` is its target), reached over a Unix socket.
Every message is one frame, ``op (1 byte) | id length (u16) | payload length (u32) |
id | payload`` (little-endian):

- ``PUT`` appends the payload (one page) to the request's pages;
- ``PUT_MANY`` appends several: the payload is ``u32 length | page`` per page (a
  batch put: one message, so one socket write on the sender's side, per batch);
- ``SEAL`` marks the request complete: a ``GET`` waiting for it returns;
- ``GET`` waits until the request is sealed (``GET_TIMEOUT_S`` at most), answers
  ``u32 count`` then each page as ``u32 length | bytes``, and forgets the request;
  a request not sealed in time answers ``count = 0xFFFFFFFF``;
- ``DROP`` forgets a request (its pages are never fetched: the client went away).

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
    __slots__ = ("pages", "sealed")

    def __init__(self) -> None:
        self.pages: list[bytes] = []
        self.sealed = False


class _Store:
    def __init__(self) -> None:
        self.entries: dict[str, _Pages] = {}
        self.cond = threading.Condition()

    def put(self, rid: str, page: bytes) -> None:
        with self.cond:
            self.entries.setdefault(rid, _Pages()).pages.append(page)

    def put_many(self, rid: str, payload: bytes) -> None:
        pages, off = [], 0
        while off < len(payload):
            (n,) = _U32.unpack_from(payload, off)
            if off + 4 + n > len(payload):
                raise ConnectionError(f"PUT_MANY for {rid}: a page of {n} bytes runs past the message")
            pages.append(payload[off + 4 : off + 4 + n])
            off += 4 + n
        with self.cond:
            self.entries.setdefault(rid, _Pages()).pages.extend(pages)

    def seal(self, rid: str) -> None:
        with self.cond:
            self.entries.setdefault(rid, _Pages()).sealed = True
            self.cond.notify_all()

    def get(self, rid: str, timeout: float) -> list[bytes] | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (rid in self.entries and self.entries[rid].sealed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.entries.pop(rid).pages

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
                    pages = store.get(rid, GET_TIMEOUT_S)
                    if pages is None:
                        sock.sendall(_U32.pack(MISSING))
                        continue
                    parts: list[bytes] = [_U32.pack(len(pages))]
                    for p in pages:
                        parts += (_U32.pack(len(p)), p)
                    sock.sendall(b"".join(parts))
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
        payload = b"".join(_U32.pack(len(p)) + p for p in pages)
        key = rid.encode()
        self.sock.sendall(_HEADER.pack(PUT_MANY, len(key), len(payload)) + key + payload)

    def seal(self, rid: str) -> None:
        self._send(SEAL, rid)

    def drop(self, rid: str) -> None:
        self._send(DROP, rid)

    def get(self, rid: str) -> list[bytes] | None:
        """The request's pages in put order, once sealed; None if not sealed in time."""
        self._send(GET, rid)
        count = _U32.unpack(self._read(4))[0]
        if count == MISSING:
            return None
        return [self._read(_U32.unpack(self._read(4))[0]) for _ in range(count)]

    def _read(self, n: int) -> bytes:
        data = self._rfile.read(n)
        if len(data) != n:
            raise ConnectionError("KV store connection closed")
        return data

    def close(self) -> None:
        self._rfile.close()
        self.sock.close()
