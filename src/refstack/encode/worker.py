"""An encode worker of ``--disagg epd``: a process that runs the vision encoder.

It gets ``("encode", rid, k, key, pixels, sent_at)`` from the front end, takes up to
``encode_batch_size`` queued images into one encoder forward (those in its encoder
cache, keyed by content hash, are not encoded again), puts each image's embeddings in
the KV store (``handoff.put_embeddings``) and answers ``("encoded", rid, k, times)``
with the image's queue, encode and store-put seconds.  One torch thread: the worker
count is the encode stage's share of the machine.

Spans (category ``encode``): ``encode`` per batch, ``encode.put`` per image, on the
thread ``encode-main`` of the process named ``encode-workerN``.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from typing import Any

import torch

from infra_agent import tracing
from refstack.disagg.kvstore import KVStoreClient
from refstack.disagg.proc import die_with_parent, set_process_name
from refstack.encode.encoder import Encoder, EncoderConfig
from refstack.encode.handoff import image_key, put_embeddings
from refstack.encode.mm import EncoderCache, ImageItem, encode_with_cache
from refstack.engine.config import EngineConfig
from refstack.engine.tracing_start import start_tracing
from refstack.model import HybridConfig

Job = tuple[str, int, str, Any, float]  # rid, k, content key, pixels, sent_at


def _reader(conn: Any, jobs: queue.SimpleQueue[Job | None], send: Any, role: str) -> None:
    """The front end's messages: jobs go to the queue; traces are answered here."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "encode":
            jobs.put(msg[1:])
        elif msg[0] == "trace":
            tracer = tracing.get_tracer()
            snap = tracer.snapshot(process_name=f"refstack {role} (pid {os.getpid()})")
            if msg[1]:
                tracer.reset()
            send(("trace", snap, tracer.origin_perf_ns))
        elif msg[0] == "stop":
            break
    jobs.put(None)


def encode_worker_main(index: int, config: EngineConfig, conn: Any, store_path: str) -> None:
    die_with_parent()
    role = f"encode-worker{index}"
    set_process_name(role)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end stops us

    def on_term(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    torch.set_num_threads(1)
    start_tracing(config, child=role)
    threading.current_thread().name = "encode-main"
    lock = threading.Lock()

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    hidden = HybridConfig.preset(config.preset).hidden_size
    encoder = Encoder(EncoderConfig.for_model(config.preset, hidden, config.seed))
    cache = EncoderCache(config.encode_cache_size)
    client = KVStoreClient(store_path)
    jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(conn, jobs, send, role), name="encode-reader", daemon=True).start()
    send(("ready", {"pid": os.getpid()}))
    try:
        while True:
            first = jobs.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < config.encode_batch_size:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    jobs.put(None)  # stop after this batch
                    break
                batch.append(job)
            _run_batch(batch, encoder, cache, client, send, config.encode_batch_size)
    finally:
        client.close()


def _run_batch(batch: list[Job], encoder: Encoder, cache: EncoderCache, client: KVStoreClient, send: Any,
               batch_size: int) -> None:
    n = encoder.tokens_per_image
    items = [ImageItem(0, n, key, pixels) for _, _, key, pixels, _ in batch]
    start = time.monotonic()
    with tracing.span("encode", cat="encode", images=len(items)) as sp:
        encoded = encode_with_cache(encoder, cache, items, batch_size)
        if sp.args is not None:
            sp.args["encoded"] = encoded
    end = time.monotonic()
    for (rid, k, _, _, sent_at), it in zip(batch, items):
        t0 = time.monotonic()
        assert it.embeds is not None
        try:
            with tracing.span("encode.put", cat="encode", request_id=rid):
                put_embeddings(client, image_key(rid, k), it.embeds)
        except OSError:
            send(("encode_failed", rid))
            continue
        send(("encoded", rid, k, {"queue_s": max(0.0, start - sent_at), "encode_s": end - start,
                                  "put_s": time.monotonic() - t0}))
