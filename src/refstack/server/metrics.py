"""Prometheus metrics, named after vLLM's under a ``refstack:`` prefix.

Each app gets its own ``CollectorRegistry`` so two servers (or two test apps) in one
process never share counters.  The engine thread reports through the
``EngineObserver`` methods; prometheus_client's metric objects are thread-safe.

A window's phase time is the difference of a histogram's ``_sum`` / ``_count``
scraped before and after it, as with vLLM.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from refstack.engine import Engine, RequestStats

# From 1 ms (a tiny-model CPU step) to 100 s (a long request on a busy box).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)
LABELS = ("model_name",)


class EngineMetrics:
    """Implements ``EngineObserver``; one instance per app."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)

        lbl = {"model_name": model_name}
        self.queue_time = hist("refstack:request_queue_time_seconds", "Time from arrival to first scheduling.").labels(**lbl)
        self.prefill_time = hist("refstack:request_prefill_time_seconds", "Time from first scheduling to first token.").labels(**lbl)
        self.decode_time = hist("refstack:request_decode_time_seconds", "Time from first token to finish.").labels(**lbl)
        self.ttft = hist("refstack:time_to_first_token_seconds", "Time from arrival to first token.").labels(**lbl)
        self.e2e = hist("refstack:e2e_request_latency_seconds", "Time from arrival to finish.").labels(**lbl)
        self.tpot = hist("refstack:time_per_output_token_seconds",
                         "Mean time per output token after the first, one sample per request.").labels(**lbl)
        # Requests with images only (refstack.encode): arrival -> encode start, the encoder,
        # the embeddings' way to the prefill engine (0 when encoded inline).
        self.encode_queue_time = hist("refstack:request_encode_queue_time_seconds",
                                      "Image requests: time from arrival to the encoder starting on them.").labels(**lbl)
        self.encode_time = hist("refstack:request_encode_time_seconds",
                                "Image requests: time in the vision encoder.").labels(**lbl)
        self.encode_transfer_time = hist("refstack:request_encode_transfer_time_seconds",
                                         "Image requests: time moving embeddings to the prefill engine.").labels(**lbl)
        self.prompt_tokens = Counter("refstack:prompt_tokens", "Prefilled prompt tokens.", LABELS,
                                     registry=self.registry).labels(**lbl)
        self.generation_tokens = Counter("refstack:generation_tokens", "Generated tokens.", LABELS,
                                         registry=self.registry).labels(**lbl)
        self._success = Counter("refstack:request_success", "Requests finished normally.",
                                ("model_name", "finished_reason"), registry=self.registry)
        for reason in ("stop", "length"):  # present from the start, so a scrape-diff sees 0 -> n
            self._success.labels(model_name=model_name, finished_reason=reason)
        self.aborted = Counter("refstack:request_aborted", "Requests aborted (client gone) or failed.",
                               LABELS, registry=self.registry).labels(**lbl)
        self.running = Gauge("refstack:num_requests_running", "Requests holding a slot.", LABELS,
                             registry=self.registry).labels(**lbl)
        self.waiting = Gauge("refstack:num_requests_waiting", "Requests queued for a slot.", LABELS,
                             registry=self.registry).labels(**lbl)
        self.slots_used = Gauge("refstack:num_slots_used", "Cache slots (KV rows + KDA state) in use.", LABELS,
                                registry=self.registry).labels(**lbl)

    def bind(self, engine: Engine) -> None:
        """Gauges read the engine's counts at scrape time, so they never go stale."""
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.slots_used.set_function(lambda: engine.num_slots_used)

    # ---- EngineObserver -----------------------------------------------------------
    def on_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def on_request_finished(self, stats: RequestStats) -> None:
        if stats.finish_reason not in ("stop", "length"):
            self.aborted.inc()
            return
        self._success.labels(model_name=self.model_name, finished_reason=stats.finish_reason).inc()
        self.queue_time.observe(stats.queue_time)
        self.prefill_time.observe(stats.prefill_time)
        self.decode_time.observe(stats.decode_time)
        self.ttft.observe(stats.ttft)
        self.e2e.observe(stats.e2e)
        if stats.encode_time is not None:
            self.encode_queue_time.observe(stats.encode_queue_time or 0.0)
            self.encode_time.observe(stats.encode_time)
            self.encode_transfer_time.observe(stats.encode_transfer_time or 0.0)
        if stats.completion_tokens > 1:
            self.tpot.observe(stats.decode_time / (stats.completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
