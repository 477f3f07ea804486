"""The prefill and decode workers of disaggregated serving.

A worker is a process (``worker_main``) that runs one engine and talks to the front
end over a ``multiprocessing`` connection (pickled tuples, see ``frontend``).

**Prefill** (``prefill.PrefillEngine``): a request runs until its first token is
sampled.  The token goes to the front end at once (so time to first token is the prefill
worker's); then, unless the request already finished, it is *handed off*: it leaves the
running batch, its attention KV rows for the prompt and its KDA states go to the KV store
(after the whole prefill, or layer by layer during it: ``kv_transfer_granularity``), and
the front end hears of it once they are sealed there.  ``prefill`` describes the modes.

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
from typing import Any

import torch

from infra_agent import tracing
from refstack.disagg.engine_base import Send, WorkerEngine
from refstack.disagg.kvstore import KVStoreClient
from refstack.disagg.pages import Snapshot, install, unpack
from refstack.disagg.prefill import PrefillEngine
from refstack.disagg.proc import die_with_parent, set_process_name
from refstack.engine import EngineConfig
from refstack.engine.request import Request
from refstack.engine.sampling import SamplingParams
from refstack.engine.tracing_start import start_tracing

log = logging.getLogger(__name__)
RECEIVE_THREAD = "kv-receive"


class DecodeEngine(WorkerEngine):
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
