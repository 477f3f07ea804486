"""The front end of disaggregated serving: the engine the HTTP server talks to.

``DisaggEngine`` has the engine's interface as far as the server uses it (``submit``,
``add_request``, ``abort``, counts, ``tokenizer``, ``max_seq_len``), but owns no model:
it starts three processes (multiprocessing ``spawn``) and routes requests between them:

    KV store (kvstore.serve_forever, a Unix socket)
    prefill worker (worker.worker_main "prefill")  --pages-->  KV store
    decode worker  (worker.worker_main "decode")   <--pages--  KV store

A request goes to the prefill worker; its first token comes back from there.  When
the prefill worker has put the request's pages into the store it reports a handoff,
and the request goes on to the decode worker (``adopt``) with its first token, text
and sampler state; every later token comes from there.  The front end computes the
request's metrics (its clock, ``time.monotonic``, is the workers' too).

Lifetime: the processes start in the constructor (their models are built before the
server says it listens) and stop with ``stop()``.  They are daemonic children that
also get SIGTERM if this process dies (``PR_SET_PDEATHSIG``).  If one of them dies
while serving, every open request fails, and ``on_failure`` is called (the CLI then
shuts the server down and exits non-zero).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from refstack.disagg.kvstore import serve_forever
from refstack.disagg.worker import worker_main
from refstack.engine import EngineConfig, QueueFullError, RequestOutput, SamplingParams
from refstack.engine.consumers import RequestStream, run_to_completion
from refstack.engine.request import RequestStats, Sink
from refstack.model import ByteTokenizer, HybridConfig
from refstack.server.logprobs import LogprobParams

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class _Flight:
    """A request in flight, as the front end follows it."""

    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    arrival: float
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    where: str = "prefill"  # "prefill", "transfer" (pages on their way), "decode"
    aborted: bool = False
    tokens: int = 0  # generated so far


class _Worker:
    """A worker process as the front end's loops see it (conn, proc, send); the encode stage's
    workers are the same shape with another entry point (``main(key, config, conn, store_path)``)."""

    def __init__(self, ctx: Any, role: str, config: EngineConfig, store_path: str,
                 main: Callable[..., None] = worker_main, key: Any = None) -> None:
        self.role = role
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=main, args=(role if key is None else key, config, child, store_path),
                                name=f"refstack-{role}", daemon=True)
        self.proc.start()
        child.close()
        self.lock = threading.Lock()
        self.info: dict[str, Any] = {}
        self.trace_reply: tuple[threading.Event, list[Any]] | None = None

    def send(self, msg: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(msg)


class DisaggEngine:
    """Routes requests through a prefill and a decode worker; see the module docstring."""

    def __init__(self, config: EngineConfig, observer: Any = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.observer = observer
        self.on_failure = on_failure
        self.tokenizer = ByteTokenizer()
        overrides = {"max_seq_len": config.max_seq_len} if config.max_seq_len else {}
        # The routes read the vocabulary size from model.config; no weights live here.
        self.model = SimpleNamespace(config=HybridConfig.preset(config.preset).with_overrides(**overrides))
        self.max_seq_len = config.max_seq_len or self.model.config.max_seq_len
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self._stopping = False
        self.failure: str | None = None
        self._threads: list[threading.Thread] = []
        ctx = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="refstack-kv-")
        self.store_path = os.path.join(self._dir, "kv.sock")
        ready, child = ctx.Pipe(duplex=False)
        self.store = ctx.Process(target=serve_forever, args=(self.store_path, child), name="refstack-kvstore", daemon=True)
        self.store.start()
        child.close()
        self.workers: dict[str, _Worker] = {}
        try:
            if not ready.poll(START_TIMEOUT_S):
                raise RuntimeError("the KV store did not start")
            ready.recv()
            for role in ("prefill", "decode"):
                self.workers[role] = _Worker(ctx, role, config, self.store_path)
            self._start_more_workers(ctx)  # --disagg epd: its encode workers start alongside
            for w in self.workers.values():
                if not w.conn.poll(START_TIMEOUT_S):
                    raise RuntimeError(f"the {w.role} worker did not start")
                msg = w.conn.recv()
                assert msg[0] == "ready", msg
                w.info = msg[1]
        except BaseException:
            self._terminate()
            raise
        info = self.workers["prefill"].info
        self.dtype: str = info["dtype"]
        self.native_kernels: bool = info["native_kernels"]
        self.num_running = 0
        self.num_slots_used = 0
        self._num_waiting = 0

    def _start_more_workers(self, ctx: Any) -> None:
        """Start workers beyond prefill and decode into ``self.workers`` (a subclass's); each
        must answer ``("ready", info)`` first, and is then read, watched and stopped as they are."""

    # ---- the engine's interface ----------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def is_running(self) -> bool:
        return (bool(self._threads) and not self._stopping and self.failure is None and self.store.is_alive()
                and all(w.proc.is_alive() for w in self.workers.values()))

    def start(self) -> None:
        for w in self.workers.values():
            t = threading.Thread(target=self._read, args=(w,), name=f"disagg-{w.role}-reader", daemon=True)
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._watch, name="disagg-watchdog", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        for w in self.workers.values():
            try:
                w.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            w.proc.join(max(0.1, deadline - time.monotonic()))
        self._terminate()
        self._fail_all("error")

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None) -> str:
        assert len(prompt_ids) >= 1, "a prompt needs at least one token"
        rid = request_id or f"req-{next(self._ids)}"
        with self._lock:
            if self._num_waiting >= self.config.max_waiting:
                raise QueueFullError(f"{self._num_waiting} requests already waiting (max_waiting)")
            if self.failure is not None:
                raise RuntimeError(self.failure)
            self._num_waiting += 1
            self._flights[rid] = _Flight(list(prompt_ids), params, sink, time.monotonic())
        self.workers["prefill"].send(("add", rid, list(prompt_ids), params))
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            f = self._flights.get(request_id)
            if f is None:
                return
            f.aborted = True
            where = f.where
        if where in ("prefill", "decode"):
            try:
                self.workers[where].send(("abort", request_id))
            except OSError:
                pass
        # In transfer: dropped when its handoff arrives (see _on_handoff).

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        stream = RequestStream(self, asyncio.get_running_loop())  # type: ignore[arg-type]
        stream.request_id = self.add_request(prompt_ids, params, stream.sink, request_id)
        return stream

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        return run_to_completion(self, prompts, params)  # type: ignore[arg-type]

    # ---- traces -------------------------------------------------------------------------
    def worker_traces(self, reset: bool, timeout: float = 10.0) -> list[tuple[dict[str, Any], int]]:
        """Each worker's trace snapshot and its span clock origin (perf_counter ns)."""
        out = []
        for w in self.workers.values():
            event: threading.Event = threading.Event()
            box: list[Any] = []
            w.trace_reply = (event, box)
            w.send(("trace", reset))
            if event.wait(timeout) and box:
                out.append((box[0], box[1]))
        return out

    # ---- the workers' messages ---------------------------------------------------------------
    def _read(self, w: _Worker) -> None:
        while True:
            try:
                msg = w.conn.recv()
            except (EOFError, OSError):
                return  # the watchdog reports a dead worker
            try:
                self._dispatch(w, msg)
            except Exception:  # a bad message must not kill the reader
                log.exception("disagg: cannot handle %s from the %s worker", msg[0], w.role)

    def _dispatch(self, w: _Worker, msg: tuple[Any, ...]) -> None:
        op = msg[0]
        if op == "out":
            self._on_output(msg[1], msg[2], msg[3])
        elif op == "handoff":
            self._on_handoff(msg[1], msg[2])
        elif op == "failed":
            self._fail(msg[1], "error")
        elif op == "trace" and w.trace_reply is not None:
            event, box = w.trace_reply
            box += [msg[1], msg[2]]
            event.set()

    def _on_output(self, out: RequestOutput, entries: list[Any] | None, scheduled_at: float) -> None:
        with self._lock:
            f = self._flights.get(out.request_id)
            if f is None:
                return
            if scheduled_at and not f.scheduled_at:
                f.scheduled_at = scheduled_at
            f.tokens = max(f.tokens, out.completion_tokens)
            first = bool(out.token_ids) and not f.first_token_at
            if first:
                f.first_token_at = time.monotonic()
                self._num_waiting -= 1
                self.num_running += 1
            if out.finished:
                del self._flights[out.request_id]
                if f.first_token_at:
                    self.num_running -= 1
                else:
                    self._num_waiting -= 1
            self.num_slots_used = self.num_running
        if entries and isinstance(f.params, LogprobParams):
            f.params.entries.extend(entries)
        if self.observer is not None:
            if first:
                self.observer.on_prompt_tokens(len(f.prompt_ids))
            if out.token_ids:
                self.observer.on_generation_tokens(len(out.token_ids))
            if out.finished:
                self.observer.on_request_finished(self._stats(f, out))
        f.sink(out)

    def _on_handoff(self, rid: str, meta: dict[str, Any]) -> None:
        with self._lock:
            f = self._flights.get(rid)
            if f is not None and not f.aborted:
                f.where = "decode"
        if f is None or f.aborted:
            # Nobody waits for it: the decode worker drops its pages from the store.
            self.workers["decode"].send(("discard", rid))
            if f is not None:
                self._fail(rid, "abort")
            return
        self.workers["decode"].send(("adopt", rid, f.prompt_ids, f.params, meta))

    def _stats(self, f: _Flight, out: RequestOutput) -> RequestStats:
        now = time.monotonic()
        first = f.first_token_at or now
        scheduled = f.scheduled_at or first
        return RequestStats(out.request_id, out.finish_reason or "error", out.prompt_tokens, out.completion_tokens,
                            queue_time=max(0.0, scheduled - f.arrival), prefill_time=max(0.0, first - scheduled),
                            decode_time=now - first, ttft=first - f.arrival, e2e=now - f.arrival)

    def _fail(self, rid: str, reason: str) -> None:
        with self._lock:
            f = self._flights.get(rid)
        if f is None:
            return
        if f.where == "decode" and reason == "error":
            try:
                self.workers["decode"].send(("abort", rid))
            except OSError:
                pass
        self._on_output(RequestOutput(rid, "", (), True, reason, len(f.prompt_ids), f.tokens), None, 0.0)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            rids = list(self._flights)
        for rid in rids:
            self._fail(rid, reason)

    def _watch(self) -> None:
        """Wait on the children's sentinels; one ending while serving fails the server."""
        procs = {w.proc.sentinel: w.role for w in self.workers.values()}
        procs[self.store.sentinel] = "KV store"
        ready = multiprocessing.connection.wait(list(procs))
        if self._stopping:
            return
        role = procs[ready[0]]
        proc = self.store if role == "KV store" else self.workers[role].proc
        proc.join(1.0)
        self.failure = f"the {role} process died (exit code {proc.exitcode}); shutting down"
        log.error("refstack disagg: %s", self.failure)
        self._fail_all("error")
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def _terminate(self) -> None:
        """End every child still alive (SIGTERM, then SIGKILL) and remove the socket folder."""
        procs = [w.proc for w in self.workers.values()] + [self.store]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        try:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)
        except OSError:
            pass
