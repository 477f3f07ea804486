"""The engine: a step loop on its own thread, fed and drained thread-safely.

Other threads call ``add_request`` / ``abort`` (both only touch a locked inbox); the loop
thread ("engine-loop") owns the scheduler, the model and the cache, and hands each step's
deltas to the request's sink.  ``submit()`` adapts a sink to an asyncio consumer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from infra_agent import tracing
from refstack.engine import step_trace
from refstack.engine.config import EngineConfig
from refstack.engine.consumers import RequestStream, run_to_completion
from refstack.engine.deltas import extend_text, take_delta
from refstack.engine.heap import freeze_heap
from refstack.engine.model_setup import cache_storage, prepare_model, unsampleable_ids
from refstack.engine.request import (
    Request,
    RequestOutput,
    RequestState,
    RequestStats,
    Sink,
)
from refstack.engine.sampling import SamplingParams, make_generator, sample_tokens
from refstack.engine.scheduler import ScheduledChunk, Scheduler
from refstack.engine.step_slowdown import stretch_period
from refstack.model import ByteTokenizer, SeqChunk

log = logging.getLogger(__name__)
THREAD_NAME = "engine-loop"


def _rows_on_host(ready: list[tuple[ScheduledChunk, torch.Tensor]]) -> list[tuple[ScheduledChunk, torch.Tensor]]:
    """The step's logits rows on the CPU, in one device-to-host copy.

    Sampling stays on the CPU with each request's CPU generator, so the sampling code
    and a seed's random stream are the same on every device (only the logits differ,
    at fp32 rounding); the copy is the step's one sync.
    """
    if not ready[0][1].is_cuda:
        return ready
    rows = torch.stack([row for _, row in ready]).cpu()
    return [(c, rows[i]) for i, (c, _) in enumerate(ready)]


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_waiting``; the caller should retry later."""


class EngineObserver(Protocol):
    """Receives counts and timings from the engine thread (the server's metrics)."""

    def on_prompt_tokens(self, n: int) -> None: ...
    def on_generation_tokens(self, n: int) -> None: ...
    def on_request_finished(self, stats: RequestStats) -> None: ...


class Engine:
    def __init__(self, config: EngineConfig, model: Any = None, tokenizer: Any = None,
                 observer: EngineObserver | None = None) -> None:
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        served = prepare_model(config, model)
        model = self.model = served.model
        if tokenizer is None:
            tokenizer = ByteTokenizer()
        # What "auto" became (the model's GEMM operand type): /debug/engine and the
        # server's startup line show it, since it depends on the machine.
        self.dtype: str = served.dtype
        # What "auto" became, for /debug/engine and the startup line.
        self.device: str = served.device
        self.native_kernels = served.native_kernels
        self.tokenizer = tokenizer
        self.max_seq_len = config.max_seq_len or model.config.max_seq_len
        self.cache = model.new_cache(num_slots=config.slots, max_seq_len=self.max_seq_len,
                                     **cache_storage(config, model.config))
        self.scheduler = Scheduler(config, config.slots)
        self.observer = observer
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        # Never sampled (see _sample); LogprobEngine masks its logprobs with it too.
        self._unsampleable = unsampleable_ids(tokenizer, model.config.vocab_size)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._prev_step_start: float | None = None  # for the step_slowdown calibration knob
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []  # call_on_loop
        self._num_waiting = 0  # inbox + scheduler queue, kept under the lock for max_waiting
        self._stop = False
        self._thread: threading.Thread | None = None
        self._inline_encoder: Any = None  # refstack.encode.inline.InlineEncoder, on the first image
        # Read by /metrics from other threads; written once per step by the loop thread.
        self.num_running = 0
        self.num_slots_used = 0
        if config.gc_freeze:
            freeze_heap()

    # ---- thread-safe front door -------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None, mm: Any = None) -> str:
        """Queue a request; ``mm``: its images (``refstack.encode.mm.MMInput``), encoded
        at admission unless they come with their embeddings."""
        assert len(prompt_ids) >= 1, "a prompt needs at least one token"
        rid = request_id or f"req-{next(self._ids)}"
        # Unseeded requests still get a distinct, reproducible stream per engine seed.
        seed = params.seed if params.seed is not None else zlib.crc32(f"{self.config.seed}:{rid}".encode())
        req = Request(rid, list(prompt_ids), params, make_generator(seed), sink,
                      self.tokenizer.stream_decoder(), mm=mm)
        with self._wake:
            if self._num_waiting >= self.config.max_waiting:
                raise QueueFullError(f"{self._num_waiting} requests already waiting (max_waiting)")
            self._num_waiting += 1
            self._inbox.append(req)
            self._wake.notify()
        return rid

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def call_on_loop(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the loop thread between two steps and return its result (its
        exception is raised here).  For what must run on the thread that runs the model:
        torch.profiler records the thread that starts it.  Inline when the loop is not running."""
        if not self.is_running:
            return fn()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._wake:
            self._calls.append((fn, fut))
            self._wake.notify()
        return fut.result(timeout)

    # ---- lifecycle --------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive (False also if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        assert self._thread is None, "engine already started"
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._aborts or self._calls or self.scheduler.has_work()):
                    self._wake.wait()
                calls, self._calls = self._calls, []
                if self._stop:
                    for _, fut in calls:
                        fut.set_exception(RuntimeError("the engine stopped before the call ran"))
                    return
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller, whose call it was
                    fut.set_exception(exc)
            try:
                self.step()
            except Exception:  # a model bug must not hang every client: fail them all, keep serving
                log.exception("engine step failed; failing the running requests")
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(req, "error")

    # ---- one step ---------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling + forward + sampling step; False when there was nothing to do."""
        was_idle = not self.scheduler.has_work()
        self._drain_inbox()
        if not self.scheduler.has_work():
            return False
        step_start = time.perf_counter()
        # Time spent idle before this step is no part of a step period.
        prev_start = None if was_idle else self._prev_step_start
        self._prev_step_start = step_start
        # The step's own spans (engine.step, schedule, decode/prefill, sample) are timed
        # here, one clock read per phase boundary (each phase starts where the one before
        # it ended), and recorded when the step ends as one record of integers
        # (step_trace): at ~0.3 ms a step, span objects and the objects they kept were most
        # of what tracing cost (docs/performance.md, "Tracing overhead").  A step that
        # raises still records the phases it finished (-1 marks one that did not) and its
        # own extent.
        record = tracing.int_sink("engine")
        traced = record is not None
        clock = time.perf_counter_ns
        t_step = clock() if traced else 0
        t_sched = t_decode = t_prefill = t_sample = -1
        fused = n_ready = 0
        d_shape, p_shape = step_trace.NO_SHAPE, step_trace.EMPTY_SHAPE
        try:
            # ``schedule`` is everything up to the first forward: the scheduler, admissions,
            # the published counts and the batch's order (and, traced, its shape).
            out = self.scheduler.schedule()
            if any(r.mm is not None for r in out.admitted):
                self._encode_admitted(out.admitted)
            for req in out.admitted:
                self._on_admitted(req)
            with self._lock:
                self._num_waiting -= len(out.admitted)
            self._publish_counts()  # before any token of this step reaches a client
            ready: list[tuple[ScheduledChunk, torch.Tensor]] = []
            # Ascending slots let the model slice its caches instead of gathering.
            decode = sorted(out.decode, key=lambda c: c.request.slot)
            if traced:  # the step's shape, for regressions of span durations on it
                d_shape = step_trace.decode_shape(decode)
                if out.prefill:
                    p_shape = step_trace.shape(out.prefill)
                t_sched = clock()
            if self.config.fuse_prefill_decode and decode and out.prefill:
                # One pass over the weights for both; traced as a "prefill" step that also
                # carries the decode batch.
                fused = 1
                ready += self._forward(decode + out.prefill)
                t_prefill = clock() if traced else -1
            else:
                if decode:
                    ready += self._forward(decode)
                    t_decode = clock() if traced else -1
                if out.prefill:
                    ready += self._forward(out.prefill)
                    t_prefill = clock() if traced else -1
            if ready:
                n_ready = len(ready)
                self._sample(_rows_on_host(ready))
                t_sample = clock() if traced else -1
            if self.config.step_delay_ms > 0:
                with tracing.span("step_delay", cat="engine"):
                    time.sleep(self.config.step_delay_ms / 1000.0)
            if self.config.step_slowdown > 0:
                stretch_period(self.config.step_slowdown, step_start, prev_start)
        finally:
            if record is not None:
                layout = step_trace.layout()
                record(layout.pack(layout.id, t_step, t_sched, t_decode, t_prefill, t_sample, clock(), fused, n_ready,
                                   *d_shape, *p_shape))
        return True

    def _encode_admitted(self, admitted: list[Request]) -> None:
        """Encode the images of the requests admitted this step, here on the engine thread
        (inline encode: every request of the step waits for it); built on first use."""
        if self._inline_encoder is None:
            from refstack.encode.inline import InlineEncoder

            self._inline_encoder = InlineEncoder(self.config, self.model.config)
        self._inline_encoder.encode([r for r in admitted if r.mm is not None])

    def _on_admitted(self, req: Request) -> None:
        """A waiting request just took ``req.slot``: clear the slot's recurrent state."""
        self.cache.reset_slot(req.slot)

    def _forward(self, chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, torch.Tensor]]:
        logits = self._run_model(
            chunks, [SeqChunk(slot=c.request.slot, token_ids=c.token_ids, start_pos=c.start_pos,
                              embeds=None if c.request.mm is None else
                              c.request.mm.chunk_embeds(c.start_pos, len(c.token_ids))) for c in chunks])
        ready = []
        prompt_done = 0
        for i, c in enumerate(chunks):
            c.request.num_computed += len(c.token_ids)
            if c.completes_prefill:
                ready.append((c, logits[i]))
                if not c.request.output_ids:
                    prompt_done += len(c.request.prompt_ids)
        if prompt_done and self.observer is not None:
            self.observer.on_prompt_tokens(prompt_done)
        return ready

    def _run_model(self, chunks: list[ScheduledChunk], seqs: list[SeqChunk]) -> torch.Tensor:
        """The model's next-token logits for the step's chunks.  A subclass may ask the model
        for more (``LogprobEngine``: every prompt position of a request that echoes its
        prompt with logprobs)."""
        return self.model.forward_chunks(seqs, self.cache)

    def _sample(self, ready: list[tuple[ScheduledChunk, torch.Tensor]]) -> None:
        reqs = [c.request for c, _ in ready]
        logits = torch.stack([row for _, row in ready])
        # Never sample an id the tokenizer cannot print or that only frames a prompt
        # (unused padding ids, bos, pad, im_start): random weights pick them often, and
        # a client would see a token with no text.
        logits.masked_fill_(self._unsampleable[: logits.shape[-1]], float("-inf"))
        tokens = sample_tokens(logits,
                               [r.params for r in reqs], [r.generator for r in reqs])
        # Metrics first, deltas after: a client that scrapes /metrics right after its
        # last token must already see that token counted.
        if self.observer is not None:
            self.observer.on_generation_tokens(len(tokens))
        now = time.monotonic()
        for req, tok in zip(reqs, tokens):
            if not req.output_ids:
                req.first_token_at = now
                tracing.instant("engine.first_token", cat="engine", request_id=req.request_id)
            req.output_ids.append(tok)
            reason = self._append_text(req, tok)
            if reason is None and len(req.output_ids) >= req.params.max_tokens:
                reason = "length"
            if reason is None and req.num_tokens >= self.max_seq_len:
                reason = "length"  # the context is full; the next token has no cache row
            if reason is not None:
                self._finish(req, reason)
            else:
                self._emit(req, finished=False)

    def _append_text(self, req: Request, tok: int) -> str | None:
        """Extend the request's text; the finish reason if an EOS or stop string ended it."""
        return extend_text(req, tok, self.eos_ids)

    def _emit(self, req: Request, finished: bool) -> None:
        """Hand the request's sink what it has not seen yet (see ``deltas.take_delta``)."""
        out = take_delta(req, finished)
        if out is not None:
            req.sink(out)

    def _finish(self, req: Request, reason: str) -> None:
        if req.state is RequestState.RUNNING:
            self.scheduler.finish(req)
        elif req.state is RequestState.WAITING:
            with self._lock:
                self._num_waiting -= 1
            if req in self.scheduler.waiting:
                self.scheduler.waiting.remove(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        if reason not in ("abort", "error"):
            req.text += req.decoder.flush()
        # Counts and metrics before the final delta, so the client never sees its request
        # finished while /metrics still shows it running.
        self._publish_counts()
        if self.observer is not None:
            self.observer.on_request_finished(req.stats())
        self._emit(req, finished=True)

    def _publish_counts(self) -> None:
        self.num_running = len(self.scheduler.running)
        self.num_slots_used = self.scheduler.num_slots_used

    def _drain_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in new:
            self.scheduler.add(req)
            tracing.instant("engine.admit", cat="engine", request_id=req.request_id)  # end of admission (TTFT split)
        for rid in aborts:
            target = self._find(rid)
            if target is not None:
                self._finish(target, "abort")

    def _find(self, request_id: str) -> Request | None:
        for req in itertools.chain(self.scheduler.waiting, self.scheduler.running):
            if req.request_id == request_id:
                return req
        return None

    # ---- consumers --------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None, mm: Any = None) -> RequestStream:
        """Queue a request for an asyncio consumer (call on the event loop's thread).

        Raises ``QueueFullError`` at once, before any response is started.
        """
        stream = RequestStream(self, asyncio.get_running_loop())
        stream.request_id = self.add_request(prompt_ids, params, stream.sink, request_id, mm)
        return stream

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; one cumulative output per prompt, in order.

        Drives ``step()`` itself when the loop thread is not running.
        """
        return run_to_completion(self, prompts, params)
