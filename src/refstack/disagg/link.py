"""The prefill worker's modelled link to the KV store: one NIC, a serial wire of a given
bandwidth, and the host posting messages to it without waiting for each.

``KVLink`` runs a thread, ``kv-link``, that takes posted messages in order, writes each
to the store (a real ``PUT_MANY`` on its own connection) and holds the link for
``bytes / (kv_link_gbps * 1e9)`` seconds from the moment it took the message (the
socket write counts inside that time; ``time.sleep`` for the rest, so the GIL is free
meanwhile, as a NIC's DMA needs no host CPU).  Each message is one span ``kv.send``
(category ``kv``, args ``request_id``, ``layer``, ``bytes``) on that thread: in the
timeline the wire of layer i lies beside the engine thread's compute of layer i+1.

The poster goes on at once (``post``), and waits only when it needs the pages to be out
(``finish``: a ``SEAL`` after every message of the request, then the wait, a span
``kv.wait`` on the poster's thread).  A message that fails (the store connection broke,
a request id the protocol cannot frame) fails its request only: its later messages are
skipped, ``finish`` raises ``LinkError`` naming it, and the next request starts on a
fresh connection.  ``drop`` forgets a request's pages in the store after its messages
(a request that finished at its first token: nobody fetches them).

A fixed bandwidth makes the link/compute balance a property of the machine: a link as
slow as the prefill on a loaded 2-core box is five times slower than it on an idle one.
``compute_ratio`` > 0 models the link from the compute instead: the engine reports each
forward's start and wall time (``forward_started``, ``forward_ended``), the link counts
the bytes posted, and a message holds the wire ``compute_ratio`` x its bytes x (forward
seconds / bytes posted).  A forward's bytes leave during it (layer granularity) or right
after it (request), so at the next forward's start both are in: the sums are folded
there, each decayed per forward so the pace follows the machine's.  With ratio 1 a
request's KV takes as long on the wire as its prefill took to compute, on any machine;
messages posted before the first fold (the warm-up's first forward) take no wire time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from infra_agent import tracing
from refstack.disagg.kvstore import GET_TIMEOUT_S, KVStoreClient

log = logging.getLogger(__name__)
LINK_THREAD = "kv-link"
DECAY = 0.95  # per forward, of the sums that set a compute-paced link's seconds per byte


class LinkError(RuntimeError):
    """A request's pages did not all reach the store."""


class KVLink:
    """See the module docstring.  ``post``/``finish``/``drop`` may be called from any thread;
    one request's calls come from one thread at a time (its order is the store's)."""

    def __init__(self, store_path: str, gbps: float, compute_ratio: float = 0.0) -> None:
        self.store_path = store_path
        self.compute_ratio = compute_ratio
        self.seconds_per_byte = 1.0 / (gbps * 1e9) if gbps > 0 and compute_ratio <= 0 else 0.0
        # compute_ratio: forward seconds and bytes posted, decayed per forward (the compute's pace),
        # and the last forward's seconds and the bytes posted since the last fold, not yet in them
        self._compute_s = 0.0
        self._posted = 0.0
        self._last_s: float | None = None
        self._posted_since = 0
        self._q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: dict[str, int] = {}  # messages posted and not yet through, per request
        self._failed: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, name=LINK_THREAD, daemon=True)
        self._thread.start()

    def post(self, rid: str, pages: list[bytes], layer: int = -1) -> None:
        """Queue one message of ``pages`` for ``rid`` (``layer``: the model layer it carries, -1 all)."""
        if self.compute_ratio > 0:
            with self._cond:
                self._posted_since += sum(map(len, pages))
        self._enqueue(("put", rid, pages, layer))

    def forward_started(self) -> None:
        """A prefill forward starts: every byte of the forwards before it is posted by now."""
        if self.compute_ratio <= 0:
            return
        with self._cond:
            if self._last_s is None:
                return
            # Decayed per forward: the pace of the last few dozen forwards, not of the server's life.
            self._compute_s = DECAY * self._compute_s + self._last_s
            self._posted = DECAY * self._posted + self._posted_since
            self._last_s, self._posted_since = None, 0
            if self._posted > 0:
                self.seconds_per_byte = self.compute_ratio * self._compute_s / self._posted

    def forward_ended(self, seconds: float) -> None:
        """The forward took ``seconds`` (wall time, with the layers' sends it made on its thread)."""
        if self.compute_ratio > 0:
            with self._cond:
                self._last_s = (self._last_s or 0.0) + seconds

    def finish(self, rid: str, timeout: float = GET_TIMEOUT_S) -> None:
        """Seal ``rid`` after its messages and wait until the seal is through; ``LinkError``
        if any of its messages failed or the link did not get there in ``timeout`` seconds."""
        self._enqueue(("seal", rid))
        deadline = time.monotonic() + timeout
        with tracing.span("kv.wait", cat="kv", request_id=rid), self._cond:
            while self._pending.get(rid, 0) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LinkError(f"{rid}: the link did not carry its pages within {timeout:g} s")
                self._cond.wait(left)
            self._pending.pop(rid, None)
            error = self._failed.pop(rid, None)
        if error is not None:
            raise LinkError(f"{rid}: {error}")

    def drop(self, rid: str) -> None:
        """Forget ``rid``'s pages in the store once its messages are through (no wait)."""
        self._enqueue(("drop", rid))

    def close(self, timeout: float = 10.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _enqueue(self, msg: tuple[Any, ...]) -> None:
        with self._cond:
            self._pending[msg[1]] = self._pending.get(msg[1], 0) + 1
        self._q.put(msg)

    def _run(self) -> None:
        client: KVStoreClient | None = None
        while True:
            msg = self._q.get()
            if msg is None:
                break
            op, rid = msg[0], msg[1]
            try:
                if op == "drop" or rid not in self._failed:  # a failed request's later messages are skipped
                    client = client or KVStoreClient(self.store_path)
                    if op == "put":
                        self._send(client, rid, msg[2], msg[3])
                    elif op == "seal":
                        client.seal(rid)
                    else:
                        client.drop(rid)
            except Exception as exc:  # any failure fails this request, never the link
                log.warning("KV link: %s of %s failed: %s", op, rid, exc)
                with self._cond:
                    self._failed.setdefault(rid, f"{op} failed: {exc}")
                if client is not None and isinstance(exc, OSError):
                    client.close()  # a broken connection: the next message opens a fresh one
                    client = None
            finally:
                with self._cond:
                    if op == "drop":
                        self._pending.pop(rid, None)
                        self._failed.pop(rid, None)
                    elif rid in self._pending:
                        self._pending[rid] -= 1
                    self._cond.notify_all()
        if client is not None:
            client.close()

    def _send(self, client: KVStoreClient, rid: str, pages: list[bytes], layer: int) -> None:
        nbytes = sum(map(len, pages))
        start = time.perf_counter()
        with tracing.span("kv.send", cat="kv", request_id=rid, layer=layer, bytes=nbytes):
            client.put_many(rid, pages)
            wire = start + nbytes * self.seconds_per_byte - time.perf_counter()
            if wire > 0:
                time.sleep(wire)
