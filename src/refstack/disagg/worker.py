"""The prefill and decode workers of disaggregated serving, and the KV page codec.

A worker is a process (``worker_main``) that runs one engine and talks to the front
end over a ``multiprocessing`` connection (pickled tuples, see ``frontend``).

**Prefill** (``PrefillEngine``): a request runs until its first token is sampled.
The token goes to the front end at once (so time to first token is the prefill
worker's); then, unless the request already finished, it is *handed off*: it leaves
the running batch and its attention KV rows for the prompt and its KDA states go to
the KV store.  The slot is free for the next prefill once they are out.

- ``kv_transfer`` on: zero copy, as a connector that reads the registered cache does
  (Mooncake, NIXL): the engine thread takes views of the slot's rows and goes on; the
  thread ``kv-transfer`` packs them page by page (``pages``: per page a slice,
  ``numpy().tobytes()``, the prefix block key and a CRC-32 in a header), pushes them
  ``PUT_BATCH`` pages per store message, seals the request and tells the front end,
  while the engine thread computes the next prefill.  Only then is the slot given back
  (``_free_sent``, on the engine thread): a transfer that falls behind holds slots, and
  with every slot held the next prefill waits, as a prefill instance whose KV blocks
  are still being sent cannot admit new requests.  That packing is Python work: it
  needs the GIL, and it runs when the engine thread lets go of it (torch ops, native
  kernels through ``CDLL``, the EP section when ``ep_release_gil`` is true).
- ``kv_transfer`` off: no transfer thread.  The engine thread puts the rows in one
  bulk message right after the batch (``pack_bulk``: the same block keys, one
  ``tobytes`` per tensor, one checksum, one ``PUT``) and frees the slot: the least the
  prefill side can do and still hand the decode side its cache, which makes it the
  baseline of "adding KV transfer may not cost prefill more than 5%".  The decode side
  is the same in both modes.

**Decode** (``DecodeEngine``): the thread ``kv-receive`` fetches a handed-off
request's pages from the store, rebuilds its tensors and queues the request with its
first token, sampler state and text; when the request is admitted to a slot the
rows are installed there (instead of the zeroed state of a fresh request), and it
decodes from position P as if it had been prefilled here.  The sampler's generator
state travels with the pages, so seeded sampling continues exactly.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from infra_agent import tracing
from refstack.disagg.kvstore import KVStoreClient
from refstack.disagg.pages import (
    Snapshot,
    batches,
    capture,
    install,
    pack_bulk,
    pack_pages,
    unpack,
)
from refstack.disagg.proc import die_with_parent, set_process_name
from refstack.engine import EngineConfig
from refstack.engine.request import Request, RequestOutput, RequestState
from refstack.engine.sampling import SamplingParams
from refstack.engine.tracing_start import start_tracing
from refstack.server.logprobs import LogprobEngine, LogprobParams

log = logging.getLogger(__name__)
TRANSFER_THREAD = "kv-transfer"
RECEIVE_THREAD = "kv-receive"

def _generator_state(gen: torch.Generator) -> bytes:
    return gen.get_state().numpy().tobytes()


# ---- the engines -----------------------------------------------------------------------
Send = Callable[[tuple[Any, ...]], None]


class _WorkerEngine(LogprobEngine):
    """An engine whose requests report to the front end through ``send``."""

    def __init__(self, config: EngineConfig, send: Send, store_path: str) -> None:
        super().__init__(config)
        self._send = send
        self._store_path = store_path
        self._emitting: Request | None = None

    def _emit(self, req: Request, finished: bool) -> None:
        self._emitting = req
        try:
            super()._emit(req, finished)
        finally:
            self._emitting = None

    def sink_for(self, params: SamplingParams) -> Callable[[RequestOutput], None]:
        """Forwards each delta, with the logprob entries it added and when the request was scheduled
        (entries the params arrived with, the prefill side's, went to the front end already)."""
        sent = [len(params.entries) if isinstance(params, LogprobParams) else 0]

        def sink(out: RequestOutput) -> None:
            entries = None
            if isinstance(params, LogprobParams):
                entries = params.entries[sent[0]:]
                sent[0] = len(params.entries)
            req = self._emitting
            self._send(("out", out, entries, req.scheduled_at if req is not None else 0.0))

        return sink


class PrefillEngine(_WorkerEngine):
    def __init__(self, config: EngineConfig, send: Send, store_path: str) -> None:
        super().__init__(config, send, store_path)
        self._jobs: queue.SimpleQueue[tuple[dict[str, Any], Snapshot, Request] | None] = queue.SimpleQueue()
        self._sent: queue.SimpleQueue[Request] = queue.SimpleQueue()  # transferred: their slots can go
        self._in_transfer = 0  # handed-off requests whose slots the transfer thread still reads (engine thread)
        self._store: KVStoreClient | None = None  # the engine thread's (kv_transfer off)
        self._transfer: threading.Thread | None = None
        if config.kv_transfer:
            self._transfer = threading.Thread(target=self._transfer_loop, name=TRANSFER_THREAD, daemon=True)
            self._transfer.start()

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self._transfer is not None:
            self._jobs.put(None)
            self._transfer.join(timeout)

    def step(self) -> bool:
        self._free_sent()
        # Requests wait for a slot that only a transfer in flight can give back: wait for it
        # here (the GIL is free meanwhile) rather than step the scheduler in a busy loop.
        while self._in_transfer and self.scheduler.waiting and not self.scheduler.running \
                and self.scheduler.num_slots_used == self.scheduler.num_slots and not self._stop:
            with self._wake:
                self._wake.wait(0.05)
            self._free_sent()
        return super().step()

    def _free_sent(self) -> None:
        while True:
            try:
                req = self._sent.get_nowait()
            except queue.Empty:
                break
            self.scheduler._release(req)
            self._in_transfer -= 1
        self._publish_counts()

    def _emit(self, req: Request, finished: bool) -> None:
        super()._emit(req, finished)
        if not finished and req.state is RequestState.RUNNING and req.output_ids:
            self._handoff(req)

    def _handoff(self, req: Request) -> None:
        """The first token is out and the request goes on: move it to the decode worker."""
        length = req.num_computed  # the prompt; the first token enters the cache on the decode side
        meta = {"length": length, "output_ids": list(req.output_ids), "text": req.text,
                "emitted_chars": req.emitted_chars, "generator": _generator_state(req.generator),
                "scheduled_at": req.scheduled_at}
        rid = req.request_id
        if self.config.kv_transfer:
            # Zero copy, as a connector that reads the registered cache does: the pages are packed
            # straight from the slot, so the slot stays taken until the transfer thread is done.
            with tracing.span("kv.capture", cat="kv", request_id=rid, tokens=length):
                snap = capture(self.cache, req.slot, length, copy=False)
            self.scheduler.running.remove(req)
            self._in_transfer += 1
            self._jobs.put((dict(meta, request_id=rid, prompt_ids=req.prompt_ids[:length]), snap, req))
        else:
            if self._store is None:
                self._store = KVStoreClient(self._store_path)
            with tracing.span("kv.put_bulk", cat="kv", request_id=rid, tokens=length) as sp:
                payload = pack_bulk(capture(self.cache, req.slot, length, copy=False), length,
                                    self.config.kv_page_tokens, req.prompt_ids)
                self._store.put(rid, payload)
                self._store.seal(rid)
                if sp.args is not None:
                    sp.args["bytes"] = len(payload)
            self.scheduler.finish(req)  # the pages are out: the slot is free for the next prefill
        req.state = RequestState.FINISHED
        req.finish_reason = "handoff"
        req.finished_at = time.monotonic()
        self._publish_counts()
        if not self.config.kv_transfer:
            self._send(("handoff", rid, meta))

    def _transfer_loop(self) -> None:
        client = KVStoreClient(self._store_path)
        page_tokens = self.config.kv_page_tokens
        while True:
            job = self._jobs.get()
            if job is None:
                client.close()
                return
            meta, snap, req = job
            rid = meta.pop("request_id")
            prompt_ids = meta.pop("prompt_ids")
            try:
                with tracing.span("kv.transfer", cat="kv", request_id=rid, tokens=meta["length"]) as sp:
                    pages = nbytes = 0
                    for batch in batches(pack_pages(snap, meta["length"], page_tokens, prompt_ids)):
                        client.put_many(rid, batch)  # the socket write releases the GIL, once per batch
                        pages += len(batch)
                        nbytes += sum(map(len, batch))
                    client.seal(rid)
                    if sp.args is not None:
                        sp.args.update(pages=pages, bytes=nbytes)
            except Exception:  # any failure fails this request, never the thread (its slot comes back)
                log.exception("KV transfer of %s failed", rid)
                self._send(("failed", rid))
                continue
            finally:
                del snap  # views of the slot: none may outlive it
                self._sent.put(req)
                with self._wake:
                    self._wake.notify()
            self._send(("handoff", rid, meta))


class DecodeEngine(_WorkerEngine):
    def __init__(self, config: EngineConfig, send: Send, store_path: str) -> None:
        super().__init__(config, send, store_path)
        self._installs: dict[str, tuple[Snapshot, int]] = {}
        self._adoptions: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._receiver = threading.Thread(target=self._receive_loop, name=RECEIVE_THREAD, daemon=True)
        self._receiver.start()

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self._adoptions.put(None)
        self._receiver.join(timeout)

    def adopt(self, rid: str, prompt_ids: list[int], params: SamplingParams, meta: dict[str, Any]) -> None:
        self._adoptions.put((rid, prompt_ids, params, meta))

    def discard(self, rid: str) -> None:
        """A handed-off request nobody waits for: free its pages in the store."""
        self._adoptions.put((rid, None, None, None))

    def _receive_loop(self) -> None:
        client = KVStoreClient(self._store_path)
        while True:
            job = self._adoptions.get()
            if job is None:
                client.close()
                return
            rid, prompt_ids, params, meta = job
            if meta is None:
                client.drop(rid)
                continue
            try:
                with tracing.span("kv.receive", cat="kv", request_id=rid, tokens=meta["length"]):
                    pages = client.get(rid)
                    if pages is None:
                        raise RuntimeError(f"the KV store never sealed {rid}")
                    snap = unpack(pages, self.cache, meta["length"])
            except (OSError, RuntimeError, ValueError):
                log.exception("KV receive of %s failed", rid)
                self._send(("failed", rid))
                continue
            self._enqueue(rid, prompt_ids, params, meta, snap)

    def _enqueue(self, rid: str, prompt_ids: list[int], params: SamplingParams, meta: dict[str, Any],
                 snap: Snapshot) -> None:
        gen = torch.Generator()
        gen.set_state(torch.frombuffer(bytearray(meta["generator"]), dtype=torch.uint8))
        req = Request(rid, list(prompt_ids), params, gen, self.sink_for(params), self.tokenizer.stream_decoder())
        req.output_ids = list(meta["output_ids"])
        for tok in req.output_ids:
            req.decoder.feed(tok)  # the decoder's state (a partial UTF-8 character) as the prefill side left it
        req.text = meta["text"]
        req.emitted_chars = meta["emitted_chars"]
        req.emitted_tokens = len(req.output_ids)
        req.num_computed = meta["length"]
        req.scheduled_at = meta["scheduled_at"]
        with self._wake:
            self._installs[rid] = (snap, meta["length"])
            self._num_waiting += 1
            self._inbox.append(req)
            self._wake.notify()

    def _on_admitted(self, req: Request) -> None:
        with self._lock:
            entry = self._installs.pop(req.request_id, None)
        if entry is None:
            super()._on_admitted(req)
            return
        snap, length = entry
        with tracing.span("kv.install", cat="kv", request_id=req.request_id, tokens=length):
            install(self.cache, req.slot, snap, length)


# ---- the process ---------------------------------------------------------------------------
def worker_main(role: str, config: EngineConfig, conn: Any, store_path: str) -> None:
    """A worker process's target: build the engine, serve the front end's messages."""
    die_with_parent()
    set_process_name(f"{role}-worker")  # /proc/PID/comm: prefill-worker, decode-worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front end stops us

    def on_term(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    start_tracing(config, child=role)
    threading.current_thread().name = f"{role}-main"
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    from refstack.encode.handoff import EmbeddingFetcher

    fetcher = EmbeddingFetcher(store_path)
    cls = PrefillEngine if role == "prefill" else DecodeEngine
    engine = cls(config, send, store_path)
    engine.start()
    send(("ready", {"dtype": engine.dtype, "native_kernels": engine.native_kernels, "max_seq_len": engine.max_seq_len,
                    "pid": os.getpid()}))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the front end is gone
            op = msg[0]
            if op == "add":
                _, rid, prompt_ids, params, *images = msg  # images: --disagg epd's embeddings in the store
                try:
                    mm = fetcher.fetch(rid, images[0]) if images else None
                    engine.add_request(prompt_ids, params, engine.sink_for(params), request_id=rid, mm=mm)
                except Exception as exc:  # noqa: BLE001 - reported to the front end, which fails the request
                    log.warning("cannot queue %s: %s", rid, exc)
                    send(("failed", rid))
            elif op == "adopt":
                _, rid, prompt_ids, params, meta = msg
                assert isinstance(engine, DecodeEngine)
                engine.adopt(rid, prompt_ids, params, meta)
            elif op == "discard":
                assert isinstance(engine, DecodeEngine)
                engine.discard(msg[1])
            elif op == "abort":
                engine.abort(msg[1])
            elif op == "trace":
                tracer = tracing.get_tracer()
                snap = tracer.snapshot(process_name=f"refstack {role} worker (pid {os.getpid()})")
                if msg[1]:
                    tracer.reset()
                send(("trace", snap, tracer.origin_perf_ns))
            elif op == "stop":
                break
    finally:
        engine.stop()
