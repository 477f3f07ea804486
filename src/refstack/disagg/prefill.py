"""The prefill worker's engine: each request runs to its first token, then its KV leaves for
the KV store and the request is handed off to the decode worker (``worker`` describes
the protocol; docs/refstack.md, "Disaggregated serving", the modes).

Two knobs decide how the KV leaves, one who packs it and one when:

- ``kv_transfer`` true: the thread ``kv-transfer`` packs pages (``pages.pack_pages``)
  from views of the slot, which stays taken until they are out (zero copy); false: the
  engine thread packs one bulk page and the slot is free when it is out.
- ``kv_transfer_granularity`` ``request``: the pages are packed after the request's
  whole prefill; ``layer`` (``layer_split``): layer i's rows of each prefill chunk are
  packed (engine thread: one ``pack_layer`` page; transfer thread: its paged form) right
  after layer i is computed, and go out while layer i+1 computes (a KDA state with the
  prompt's last chunk).

``kv_link_gbps`` or ``kv_link_compute_ratio`` > 0 (or layer granularity) sends through
``link.KVLink``: a modelled wire that the sender posts to and later waits on
(``kv.wait``).  With ``kv_transfer`` false that wait is the engine thread's: the next
prefill step starts only when the request's pages are out, as a connector whose
``wait_for_save`` ends the forward (request granularity: the whole transfer after the
compute; layer granularity: only what the wire still holds when the last layer is done).

A request is handed off (``("handoff", rid, meta)`` to the front end) only after its
store entry is sealed behind every page, so the decode side never starts from a partial
cache.  A failed send fails that request (``("failed", rid)``) and gives its slot back.
Handoffs run after the whole step's sampling, so every first token of a batch goes out
before any wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from infra_agent import tracing
from refstack.disagg.engine_base import Send, WorkerEngine, generator_state
from refstack.disagg.kvstore import KVStoreClient
from refstack.disagg.layer_split import LayerSplit
from refstack.disagg.link import KVLink, LinkError
from refstack.disagg.pages import (
    Snapshot,
    batches,
    capture,
    pack_bulk,
    pack_layer,
    pack_pages,
)
from refstack.engine import EngineConfig
from refstack.engine.request import Request, RequestState

log = logging.getLogger(__name__)
TRANSFER_THREAD = "kv-transfer"


class PrefillEngine(WorkerEngine):
    def __init__(self, config: EngineConfig, send: Send, store_path: str) -> None:
        super().__init__(config, send, store_path)
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sent: queue.SimpleQueue[Request] = queue.SimpleQueue()  # transferred: their slots can go
        self._in_transfer = 0  # handed-off requests whose slots the transfer thread still reads (engine thread)
        self._store: KVStoreClient | None = None  # the engine thread's (kv_transfer off, no link)
        self._handoffs: list[Request] = []  # this step's, run after its sampling
        layered = config.kv_transfer_granularity == "layer"
        modelled = config.kv_link_gbps > 0 or config.kv_link_compute_ratio > 0
        self._link = KVLink(store_path, config.kv_link_gbps, config.kv_link_compute_ratio) \
            if layered or modelled else None
        self._layers = LayerSplit(self.model, self.cache, config.kv_page_tokens, self._send_layer) if layered else None
        self._transfer: threading.Thread | None = None
        if config.kv_transfer:
            self._transfer = threading.Thread(target=self._transfer_loop, name=TRANSFER_THREAD, daemon=True)
            self._transfer.start()

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        if self._transfer is not None:
            self._jobs.put(None)
            self._transfer.join(timeout)
        if self._layers is not None:
            self._layers.remove()
        if self._link is not None:
            self._link.close(timeout)

    # ---- the engine thread -------------------------------------------------------------
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

    def _run_model(self, chunks: list[Any], seqs: list[Any]) -> torch.Tensor:
        if self._link is not None:  # a link as fast as the compute learns the compute's pace here
            self._link.forward_started()
        start = time.perf_counter()
        try:
            if self._layers is None:
                return super()._run_model(chunks, seqs)
            prefill = [(c.request.request_id, c.request.slot, c.start_pos, c.start_pos + len(c.token_ids),
                        c.request.prompt_ids) for c in chunks if not c.request.output_ids]
            return self._layers.run(lambda: super(PrefillEngine, self)._run_model(chunks, seqs), prefill)
        finally:
            if self._link is not None:
                self._link.forward_ended(time.perf_counter() - start)

    def _send_layer(self, rid: str, layer: int, snap: Snapshot, p0: int, p1: int, length: int,
                    keys: list[bytes]) -> None:
        """Layer ``layer`` of a chunk of ``rid`` is computed: pack it here, or queue it for the transfer thread."""
        assert self._link is not None
        with tracing.span("kv.layer", cat="kv", request_id=rid, layer=layer, tokens=p1 - p0) as sp:
            if self._transfer is not None:
                self._jobs.put(("layer", rid, layer, snap, p0, p1, length, keys))
                return
            page = pack_layer(snap, layer, p0, p1, keys)
            self._link.post(rid, [page], layer)
            if sp.args is not None:
                sp.args["bytes"] = len(page)

    def _sample(self, ready: list[Any]) -> None:
        try:
            super()._sample(ready)
        finally:
            handoffs, self._handoffs = self._handoffs, []
        for req in handoffs:
            self._handoff(req)

    def _emit(self, req: Request, finished: bool) -> None:
        super()._emit(req, finished)
        if not finished and req.state is RequestState.RUNNING and req.output_ids:
            self._handoffs.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        super()._finish(req, reason)
        if self._layers is not None and self._layers.done(req.request_id):
            # Finished at its first token (or failed) after its layers left: nobody fetches them.
            self._discard(req.request_id)

    def _discard(self, rid: str) -> None:
        if self._transfer is not None:
            self._jobs.put(("drop", rid))  # after its layer jobs
        elif self._link is not None:
            self._link.drop(rid)

    def _handoff(self, req: Request) -> None:
        """The first token is out and the request goes on: move it to the decode worker."""
        length = req.num_computed  # the prompt; the first token enters the cache on the decode side
        meta = {"length": length, "output_ids": list(req.output_ids), "text": req.text,
                "emitted_chars": req.emitted_chars, "generator": generator_state(req.generator),
                "scheduled_at": req.scheduled_at}
        rid = req.request_id
        layered = self._layers is not None and self._layers.done(rid)
        ok = True
        if self.config.kv_transfer:
            job: tuple[Any, ...] = ("seal", meta, req)
            if not layered:
                # Zero copy, as a connector that reads the registered cache does: the pages are packed
                # straight from the slot, so the slot stays taken until the transfer thread is done.
                with tracing.span("kv.capture", cat="kv", request_id=rid, tokens=length):
                    snap = capture(self.cache, req.slot, length, copy=False)
                job = ("request", dict(meta, prompt_ids=req.prompt_ids[:length]), snap, req)
            self.scheduler.running.remove(req)
            self._in_transfer += 1
            self._jobs.put(job)
        else:
            ok = self._send_now(req, length, layered)
            self.scheduler.finish(req)  # the pages are out (or failed): the slot is free for the next prefill
        req.state = RequestState.FINISHED
        req.finish_reason = "handoff"
        req.finished_at = time.monotonic()
        self._publish_counts()
        if not self.config.kv_transfer:
            self._send(("handoff", rid, meta) if ok else ("failed", rid))

    def _send_now(self, req: Request, length: int, layered: bool) -> bool:
        """The engine thread's send (``kv_transfer`` off): the bulk page unless the layers left
        already, then the wait for the link.  False when the request's pages did not get out."""
        rid = req.request_id
        if not layered:
            with tracing.span("kv.put_bulk", cat="kv", request_id=rid, tokens=length) as sp:
                payload = pack_bulk(capture(self.cache, req.slot, length, copy=False), length,
                                    self.config.kv_page_tokens, req.prompt_ids)
                if self._link is None:
                    if self._store is None:
                        self._store = KVStoreClient(self._store_path)
                    self._store.put(rid, payload)
                    self._store.seal(rid)
                else:
                    self._link.post(rid, [payload])
                if sp.args is not None:
                    sp.args["bytes"] = len(payload)
        if self._link is None:
            return True
        try:
            self._link.finish(rid)
            return True
        except LinkError as exc:
            log.warning("KV transfer of %s failed: %s", rid, exc)
            self._link.drop(rid)
            return False

    # ---- the kv-transfer thread ----------------------------------------------------------
    def _transfer_loop(self) -> None:
        client = KVStoreClient(self._store_path) if self._link is None else None
        broken: set[str] = set()  # requests a layer job failed for: their seal fails them
        while True:
            job = self._jobs.get()
            if job is None:
                if client is not None:
                    client.close()
                return
            op = job[0]
            if op == "layer":
                self._transfer_layer(*job[1:], broken=broken)
            elif op == "drop":
                broken.discard(job[1])
                assert self._link is not None
                self._link.drop(job[1])
            else:
                self._transfer_request(job, client, broken)
            del job  # views of the slot: none may outlive its transfer

    def _transfer_layer(self, rid: str, layer: int, snap: Snapshot, p0: int, p1: int, length: int,
                        keys: list[bytes], broken: set[str]) -> None:
        assert self._link is not None
        if rid in broken:
            return
        try:
            with tracing.span("kv.transfer", cat="kv", request_id=rid, layer=layer, tokens=p1 - p0):
                rows = (p0, p1) if layer in snap["keys"] else None
                for batch in batches(pack_pages(snap, length, self.config.kv_page_tokens, (), [layer], keys, rows)):
                    self._link.post(rid, batch, layer)
        except Exception:  # noqa: BLE001 - fails this request at its seal, never the thread
            log.exception("KV transfer of %s layer %d failed", rid, layer)
            broken.add(rid)

    def _transfer_request(self, job: tuple[Any, ...], client: KVStoreClient | None, broken: set[str]) -> None:
        """A ``request`` job (pack every page, then seal) or a ``seal`` job (the layers left already)."""
        op, meta, req = job[0], job[1], job[-1]
        rid = req.request_id
        meta = {k: v for k, v in meta.items() if k != "prompt_ids"}
        try:
            if op == "request":
                with tracing.span("kv.transfer", cat="kv", request_id=rid, tokens=meta["length"]) as sp:
                    pages = nbytes = 0
                    for batch in batches(pack_pages(job[2], meta["length"], self.config.kv_page_tokens,
                                                    job[1]["prompt_ids"])):
                        if client is not None:
                            client.put_many(rid, batch)  # the socket write releases the GIL, once per batch
                        else:
                            assert self._link is not None
                            self._link.post(rid, batch)
                        pages += len(batch)
                        nbytes += sum(map(len, batch))
                    if sp.args is not None:
                        sp.args.update(pages=pages, bytes=nbytes)
            if rid in broken:
                broken.discard(rid)
                raise LinkError(f"{rid}: a layer's pages could not be packed")
            if client is not None:
                client.seal(rid)
            else:
                assert self._link is not None
                self._link.finish(rid)
        except Exception:  # any failure fails this request, never the thread (its slot comes back)
            log.exception("KV transfer of %s failed", rid)
            if self._link is not None:
                self._link.drop(rid)
            self._send(("failed", rid))
            return
        finally:
            self._sent.put(req)
            with self._wake:
                self._wake.notify()
        self._send(("handoff", rid, meta))
