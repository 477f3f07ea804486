"""The prefill and decode workers of disaggregated serving, and the KV page codec.

A worker is a process (``worker_main``) that runs one engine and talks to the front
end over a ``multiprocessing`` connection (pickled tuples, see ``frontend``).

**Prefill** (``PrefillEngine``): a request runs until its first token is sampled.
The token goes to the front end at once (so time to first token is the prefill
worker's); then, unless the request already finished, it is *handed off*: its slot's
attention KV rows for the prompt and its KDA states are captured, the slot is freed
for the next prefill, and the pages go to the KV store.

- ``kv_transfer`` on: the engine thread only clones the slot's rows (a few memcpys,
  GIL released); the thread ``kv-transfer`` packs them page by page (``pack_pages``:
  per page a slice, ``numpy().tobytes()``, a header, one store ``PUT``), seals the
  request and tells the front end, while the engine thread computes the next prefill.
  That packing is Python work: it needs the GIL, and it runs when the engine thread
  lets go of it (torch ops, native kernels through ``CDLL``, the EP section when
  ``ep_release_gil`` is true).
- ``kv_transfer`` off: no transfer thread.  The engine thread puts the rows in one
  bulk message right after the batch (``pack_bulk``: one ``tobytes`` per tensor, one
  ``PUT``): the least the prefill side can do and still hand the decode side its
  cache, which makes it the baseline of "adding KV transfer may not cost prefill more
  than 5%".  The decode side is the same in both modes.

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
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from infra_agent import tracing
from refstack.disagg.kvstore import KVStoreClient
from refstack.disagg.proc import die_with_parent
from refstack.engine import EngineConfig
from refstack.engine.request import Request, RequestOutput, RequestState
from refstack.engine.sampling import SamplingParams
from refstack.model.cache import ModelCache
from refstack.server.logprobs import LogprobEngine, LogprobParams

log = logging.getLogger(__name__)
TRANSFER_THREAD = "kv-transfer"
RECEIVE_THREAD = "kv-receive"

KIND_K, KIND_V, KIND_STATE, KIND_BULK = 0, 1, 2, 3
_PAGE = struct.Struct("<BHHII")  # kind, layer, head, first position, end position

Snapshot = dict[str, dict[int, torch.Tensor]]  # "keys" / "values": [Hkv, P, Dh]; "states": [H, K, V]


# ---- the page codec ------------------------------------------------------------------
def capture(cache: ModelCache, slot: int, length: int, copy: bool = True) -> Snapshot:
    """The slot's KV rows [:length] of every attention layer and its KDA states (cloned
    when ``copy``: the slot is reused while the pages are still being packed)."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format) if copy else t

    return {"keys": {l: take(k[slot, :, :length]) for l, k in cache.keys.items()},
            "values": {l: take(v[slot, :, :length]) for l, v in cache.values.items()},
            "states": {l: take(s[slot]) for l, s in cache.states.items()}}


def pack_pages(snap: Snapshot, length: int, page_tokens: int) -> Iterator[bytes]:
    """The snapshot as pages: per attention layer, ``page_tokens`` positions of K, then of
    V, all KV heads; per KDA layer, one page per head.  Each page: header + raw fp32."""
    for layer in sorted(snap["keys"]):
        for kind, t in ((KIND_K, snap["keys"][layer]), (KIND_V, snap["values"][layer])):
            for p0 in range(0, length, page_tokens):
                p1 = min(length, p0 + page_tokens)
                yield _PAGE.pack(kind, layer, 0, p0, p1) + t[:, p0:p1].numpy().tobytes()
    for layer in sorted(snap["states"]):
        state = snap["states"][layer]
        for head in range(state.shape[0]):
            yield _PAGE.pack(KIND_STATE, layer, head, 0, 0) + state[head].numpy().tobytes()


def pack_bulk(snap: Snapshot, length: int) -> bytes:
    """The snapshot as one page: every tensor's bytes in a fixed order (see ``unpack``)."""
    parts = [_PAGE.pack(KIND_BULK, 0, 0, 0, length)]
    for layer in sorted(snap["keys"]):
        parts += (snap["keys"][layer].numpy().tobytes(), snap["values"][layer].numpy().tobytes())
    parts += [snap["states"][layer].numpy().tobytes() for layer in sorted(snap["states"])]
    return b"".join(parts)


def unpack(pages: list[bytes], cache: ModelCache, length: int) -> Snapshot:
    """Pages (either form) back into tensors shaped like ``capture``'s."""
    n_kv, dh = next(iter(cache.keys.values())).shape[1::2] if cache.keys else (0, 0)
    state_shape = next(iter(cache.states.values())).shape[1:] if cache.states else (0, 0, 0)
    snap: Snapshot = {"keys": {l: torch.empty(n_kv, length, dh) for l in cache.keys},
                      "values": {l: torch.empty(n_kv, length, dh) for l in cache.values},
                      "states": {l: torch.empty(*state_shape) for l in cache.states}}

    def tensor(data: bytes | memoryview, *shape: int) -> torch.Tensor:
        # Read-only views of the received bytes: only ever copied from, never written.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape))

    for page in pages:
        kind, layer, head, p0, p1 = _PAGE.unpack_from(page)
        body = memoryview(page)[_PAGE.size:]
        if kind == KIND_BULK:
            off = 0
            kv_bytes = n_kv * length * dh * 4
            for l in sorted(cache.keys):
                for name in ("keys", "values"):
                    snap[name][l].copy_(tensor(body[off : off + kv_bytes], n_kv, length, dh))
                    off += kv_bytes
            s_bytes = int(np.prod(state_shape)) * 4
            for l in sorted(cache.states):
                snap["states"][l].copy_(tensor(body[off : off + s_bytes], *state_shape))
                off += s_bytes
        elif kind == KIND_STATE:
            snap["states"][layer][head].copy_(tensor(body, *state_shape[1:]))
        else:
            target = snap["keys" if kind == KIND_K else "values"][layer]
            target[:, p0:p1].copy_(tensor(body, n_kv, p1 - p0, dh))
    return snap


def install(cache: ModelCache, slot: int, snap: Snapshot, length: int) -> None:
    """Write a snapshot into ``slot``: KV rows [:length] and the KDA states."""
    with torch.inference_mode():
        for l, k in snap["keys"].items():
            cache.keys[l][slot, :, :length].copy_(k)
            cache.values[l][slot, :, :length].copy_(snap["values"][l])
        for l, s in snap["states"].items():
            cache.states[l][slot].copy_(s)


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
        self._jobs: queue.SimpleQueue[tuple[dict[str, Any], Snapshot] | None] = queue.SimpleQueue()
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
            with tracing.span("kv.capture", cat="kv", request_id=rid, tokens=length):
                snap = capture(self.cache, req.slot, length)
            self._jobs.put((dict(meta, request_id=rid), snap))
        else:
            if self._store is None:
                self._store = KVStoreClient(self._store_path)
            with tracing.span("kv.put_bulk", cat="kv", request_id=rid, tokens=length) as sp:
                payload = pack_bulk(capture(self.cache, req.slot, length, copy=False), length)
                self._store.put(rid, payload)
                self._store.seal(rid)
                if sp.args is not None:
                    sp.args["bytes"] = len(payload)
        self.scheduler.finish(req)  # the slot is free for the next prefill
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
            meta, snap = job
            rid = meta.pop("request_id")
            try:
                with tracing.span("kv.transfer", cat="kv", request_id=rid, tokens=meta["length"]) as sp:
                    pages = nbytes = 0
                    for page in pack_pages(snap, meta["length"], page_tokens):
                        client.put(rid, page)
                        pages += 1
                        nbytes += len(page)
                    client.seal(rid)
                    if sp.args is not None:
                        sp.args.update(pages=pages, bytes=nbytes)
            except OSError:
                log.exception("KV transfer of %s failed", rid)
                self._send(("failed", rid))
                continue
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
def _trace_env(role: str) -> None:
    """A worker writes its own trace file (``PATH`` -> ``PATH-stem.ROLE.json``), never the front end's."""
    path = os.environ.pop("INFRA_AGENT_TRACE", None)
    if path:
        root, ext = os.path.splitext(path)
        os.environ["INFRA_AGENT_TRACE"] = f"{root}.{role}{ext or '.json'}"


def worker_main(role: str, config: EngineConfig, conn: Any, store_path: str) -> None:
    """A worker process's target: build the engine, serve the front end's messages."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front end stops us

    def on_term(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    _trace_env(role)
    if config.trace:
        tracing.enable()
    threading.current_thread().name = f"{role}-main"
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

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
                _, rid, prompt_ids, params = msg
                try:
                    engine.add_request(prompt_ids, params, engine.sink_for(params), request_id=rid)
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
                snap = tracer.snapshot()
                for ev in snap["traceEvents"]:
                    if ev.get("name") == "process_name":
                        ev["args"] = {"name": f"refstack {role} worker (pid {os.getpid()})"}
                if msg[1]:
                    tracer.reset()
                send(("trace", snap, tracer.origin_perf_ns))
            elif op == "stop":
                break
    finally:
        engine.stop()
