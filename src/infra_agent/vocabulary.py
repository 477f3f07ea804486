"""The shared vocabulary: component names and finding kinds.

One set of names is used for knob ``components`` (the workspace), ``Probe.scope`` and
``Location.component`` (Feedback), so that a finding at a location can be matched to
the knobs that act there and to the probes that can measure there.

Component names are dotted paths.  The first segment must be one of ``COMPONENTS``'
top-level names; deeper segments are free (``model.rope``, ``engine.cache.prefix``),
because every stack names its own parts.  A name covers itself and everything below
it: ``model`` covers ``model.lm_head``.
"""

from __future__ import annotations

import difflib
from typing import Final

# Top-level components with what they mean; the documented sub-components are the ones
# refstack and the shipped probes use.
COMPONENTS: Final[dict[str, str]] = {
    "client": "the load generator and the network between it and the server",
    "server": "the HTTP/API layer: request parsing, tokenisation, streaming",
    "engine": "the serving engine: scheduler (engine.scheduler), step loop (engine.loop), cache (engine.cache)",
    "model": "the model's compute: model.attention, model.kda, model.moe, model.lm_head",
    "kernel": "a single kernel, as the kernel lab sees it",
    "runtime": "threads, processes and the interpreter (torch threads, the GIL)",
    "kv_transfer": "moving KV pages and states between workers (disaggregated serving)",
    "comm": "collective communication between ranks (all-reduce, gather, dispatch/combine)",
    # No finding sits here, so no finding points at a knob under it (tracing on, its
    # level): such a knob changes what is seen, not how fast the stack runs.
    "observability": "what the stack records about itself: tracing, its level, logs",
}

KNOWN_SUBCOMPONENTS: Final[tuple[str, ...]] = (
    "engine.scheduler", "engine.loop", "engine.cache", "engine.encode",
    "model.attention", "model.kda", "model.moe", "model.lm_head",
)


def check_component(name: str) -> str | None:
    """None when ``name`` is in the vocabulary, else a message with a did-you-mean."""
    head = name.split(".", 1)[0]
    if head in COMPONENTS and all(part.isidentifier() for part in name.split(".")):
        return None
    known = [*COMPONENTS, *KNOWN_SUBCOMPONENTS]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"a component under one of {sorted(COMPONENTS)}{hint}"


def covers(broad: str, narrow: str) -> bool:
    """``model`` covers ``model.lm_head`` and itself; ``model.lm`` covers nothing else."""
    return narrow == broad or narrow.startswith(broad + ".")


def related(a: str, b: str) -> bool:
    """Either name covers the other (a knob on ``engine`` acts on ``engine.scheduler``)."""
    return covers(a, b) or covers(b, a)


class FindingKind:
    """Finding kinds as constants.  Proposers and rules match on these, never on prose."""

    # serving probe
    QUEUE_DOMINATES_TTFT: Final = "queue_dominates_ttft"
    PREFILL_DOMINATES_TTFT: Final = "prefill_dominates_ttft"
    CLIENT_SERVER_TTFT_GAP: Final = "client_server_ttft_gap"
    BURSTY_STREAM: Final = "bursty_stream"
    # an image encode stage (probes/serving_encode.py)
    ENCODE_BLOCKS_TEXT: Final = "encode_blocks_text"
    ENCODE_QUEUE_DOMINATES: Final = "encode_queue_dominates"
    FAILED_REQUESTS: Final = "failed_requests"
    # answers not of the length the request fixed (ignore_eos + max_tokens): short or long
    WRONG_ANSWER_LENGTH: Final = "wrong_answer_length"
    RUN_FAILED: Final = "run_failed"
    # the engine's own telemetry and the server's CPU (probes/serving_telemetry.py)
    SERVER_CPU_STARVED: Final = "server_cpu_starved"
    PREEMPTIONS: Final = "preemptions"
    KV_CACHE_FULL: Final = "kv_cache_full"
    # kernel lab
    MISMATCH: Final = "mismatch"
    NONFINITE_OUTPUT: Final = "nonfinite_output"
    KERNEL_ERROR: Final = "kernel_error"
    WRONG_OUTPUT: Final = "wrong_output"
    KERNEL_TIMEOUT: Final = "kernel_timeout"
    SKIPPED: Final = "skipped"
    REPEATED_WORK: Final = "repeated_work"
    ROOFLINE: Final = "roofline"
    BENCH_REFUSED: Final = "bench_refused"
    BENCH_FAILED: Final = "bench_failed"
    LAUNCH_BOUND: Final = "launch_bound"
    # command checks (unit tests, linters)
    COMMAND_FAILED: Final = "command_failed"
    # timeline
    GIL_CONTENTION: Final = "gil_contention"
    NO_OVERLAP: Final = "no_overlap"
    OVERLAP_UNMEASURABLE: Final = "overlap_unmeasurable"
    THREAD_IDLE: Final = "thread_idle"
    SPAN_TREND: Final = "span_trend"
    STEP_OVERHEAD: Final = "step_overhead"
    LATENCY_RISES_WITH_POSITION: Final = "latency_rises_with_position"
    GC_PAUSE: Final = "gc_pause"
    DELTA_ATTRIBUTION: Final = "delta_attribution"
    SAMPLER_UNAVAILABLE: Final = "sampler_unavailable"
    # a thread that serves requests (an event loop, a tokenizer, an output thread) parked
    # off the GIL in a call other than its normal wait for a share of the window
    THREAD_BLOCKED: Final = "thread_blocked"
    # a step loop that spends a share of its steps moving KV out (packing it, waiting for the
    # link) before the next step: prefill waiting on a KV transfer (trace/transfer_wait.py)
    TRANSFER_WAIT: Final = "transfer_wait"
    # an asyncio loop away from its selector during a share of the TTFT or ITL tail
    LOOP_STALLS: Final = "loop_stalls"
    # quality probe (teacher-forced logprobs, candidate against baseline)
    NO_LOGPROBS: Final = "no_logprobs"
    LOGPROB_DIVERGENCE: Final = "logprob_divergence"
    TOKENIZATION_MISMATCH: Final = "tokenization_mismatch"
    # the loop itself
    PROBE_TIMEOUT: Final = "probe_timeout"
    PROBE_ERROR: Final = "probe_error"
    # the candidate's server exited at start-up: the configuration is refuted (agent/refused.py)
    SERVER_REFUSED_CONFIG: Final = "server_refused_config"

    @classmethod
    def all(cls) -> frozenset[str]:
        return frozenset(v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str))

    # Kernel findings that mean "the numbers are wrong", not "it is slow".
    CORRECTNESS: Final = frozenset({"mismatch", "nonfinite_output", "kernel_error", "wrong_output", "kernel_timeout"})
