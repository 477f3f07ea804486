"""The front end of ``--disagg epd``: the prefill/decode front end plus encode workers.

``EPDEngine`` is ``DisaggEngine`` (``refstack.disagg.frontend``) with
``encode_workers`` more processes (``refstack.encode.worker``).  A text request goes to
the prefill worker at once, as before.  A request with images first sends each image
to the encode worker its content hash picks (so one picture always meets the same
encoder cache); when every image's embeddings are sealed in the KV store, the request
goes to the prefill worker with their keys (``handoff``), which fetches them before
queueing it.  Text requests never wait for an encoder.

The encode phase of each image request is timed here, from the workers' answers:
queue (arrival -> its last image's encode start), encode (the longest batch), transfer
(the longest store put); ``RequestStats`` carries them to the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from refstack.disagg.frontend import DisaggEngine, _Flight, _Worker
from refstack.encode.handoff import ImageMeta, image_key
from refstack.encode.mm import MMInput
from refstack.encode.worker import encode_worker_main
from refstack.engine import EngineConfig, QueueFullError, RequestStats, SamplingParams
from refstack.engine.consumers import RequestStream
from refstack.engine.request import Sink


@dataclass(slots=True)
class _Encoding:
    prompt_ids: list[int]
    params: SamplingParams
    meta: list[ImageMeta]
    left: int
    queue_s: float = 0.0
    encode_s: float = 0.0
    transfer_s: float = 0.0


class EPDEngine(DisaggEngine):
    def __init__(self, config: EngineConfig, observer: Any = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self._encoding: dict[str, _Encoding] = {}
        self._times: dict[str, tuple[float, float, float]] = {}
        self.encoders: list[_Worker] = []
        super().__init__(config, observer=observer, on_failure=on_failure)

    def _start_more_workers(self, ctx: Any) -> None:
        """The encode workers, started with the prefill and decode workers (the base waits for all)."""
        for i in range(self.config.encode_workers):
            w = _Worker(ctx, f"encode{i}", self.config, self.store_path, main=encode_worker_main, key=i)
            self.encoders.append(w)
            self.workers[w.role] = w  # type: ignore[assignment]  # read, watched, traced, stopped as the others

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None, mm: MMInput | None = None) -> str:
        if mm is None or not mm.items:
            return super().add_request(prompt_ids, params, sink, request_id)
        rid = request_id or f"req-{next(self._ids)}"
        meta = [(it.offset, it.num_tokens, image_key(rid, k), it.key) for k, it in enumerate(mm.items)]
        with self._lock:
            if self._num_waiting >= self.config.max_waiting:
                raise QueueFullError(f"{self._num_waiting} requests already waiting (max_waiting)")
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self._num_waiting += 1
            self._flights[rid] = _Flight(list(prompt_ids), params, sink, time.monotonic(), where="encode")
            self._encoding[rid] = _Encoding(list(prompt_ids), params, meta, len(mm.items))
        now = time.monotonic()
        for k, it in enumerate(mm.items):
            w = self.encoders[int(it.key[:8], 16) % len(self.encoders)]
            w.send(("encode", rid, k, it.key, it.pixels, now))
        return rid

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
               mm: MMInput | None = None) -> RequestStream:
        stream = RequestStream(self, asyncio.get_running_loop())  # type: ignore[arg-type]
        stream.request_id = self.add_request(prompt_ids, params, stream.sink, request_id, mm)
        return stream

    def _dispatch(self, w: Any, msg: tuple[Any, ...]) -> None:
        if msg[0] == "encoded":
            self._on_encoded(msg[1], msg[3])
        elif msg[0] == "encode_failed":
            with self._lock:
                self._encoding.pop(msg[1], None)
            self._fail(msg[1], "error")
        else:
            super()._dispatch(w, msg)

    def _on_encoded(self, rid: str, times: dict[str, float]) -> None:
        with self._lock:
            job = self._encoding.get(rid)
            f = self._flights.get(rid)
            if job is None:
                return
            job.queue_s = max(job.queue_s, times["queue_s"])
            job.encode_s = max(job.encode_s, times["encode_s"])
            job.transfer_s = max(job.transfer_s, times["put_s"])
            job.left -= 1
            if job.left:
                return
            del self._encoding[rid]
            self._times[rid] = (job.queue_s, job.encode_s, job.transfer_s)
            aborted = f is None or f.aborted
            if f is not None:
                f.where = "prefill"
        # An aborted request still goes to the prefill worker, which fetches (and so frees) its
        # embeddings from the store, then drops it at the abort that follows.
        self.workers["prefill"].send(("add", rid, job.prompt_ids, job.params, job.meta))
        if aborted:
            self.workers["prefill"].send(("abort", rid))

    def _stats(self, f: _Flight, out: Any) -> RequestStats:
        stats = super()._stats(f, out)
        times = self._times.pop(out.request_id, None)
        if times is None:
            return stats
        return dataclasses.replace(stats, encode_queue_time=times[0], encode_time=times[1],
                                   encode_transfer_time=times[2])
