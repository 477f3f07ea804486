"""A request's lifecycle: waiting -> running (prefill, then decode) -> finished.

The engine thread owns every ``Request``; other threads only see the
``RequestOutput`` deltas handed to the request's sink, and the final
``RequestStats``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from refstack.engine.sampling import SamplingParams, StopMatcher


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request (a delta, for streaming)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Phase timings of a finished request (seconds, ``time.monotonic`` clock)."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_time: float  # arrival -> first scheduled
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> finished
    ttft: float  # arrival -> first token
    e2e: float  # arrival -> finished
    # Requests with images (refstack.encode): arrival -> encode start, the encoder's time,
    # and the embeddings' way to the prefill engine (0 inline); None without images.
    encode_queue_time: float | None = None
    encode_time: float | None = None
    encode_transfer_time: float | None = None


Sink = Callable[[RequestOutput], None]


class IncrementalDecoder(Protocol):
    """The tokenizer's stream decoder: text completed by each token, the rest at the end."""

    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    sink: Sink
    decoder: IncrementalDecoder
    state: RequestState = RequestState.WAITING
    slot: int = -1
    num_computed: int = 0  # tokens whose KV / KDA state is in the cache
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output so far, cut at a stop string if one matched
    emitted_chars: int = 0  # how much of ``text`` the sink has seen
    emitted_tokens: int = 0
    finish_reason: str | None = None
    stop_matcher: StopMatcher = field(init=False)
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    # refstack.encode.mm.MMInput for a request with images (its placeholder offsets and
    # embeddings, and the encode phase's timings); None for text.
    mm: Any = None

    def __post_init__(self) -> None:
        self.stop_matcher = StopMatcher(self.params.stop)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    def next_chunk(self, budget: int) -> list[int]:
        """The tokens to forward next: a prefill piece of at most ``budget``, or the last token."""
        if self.in_prefill:
            return self.prompt_ids[self.num_computed : self.num_computed + budget]
        assert self.num_computed == self.num_tokens - 1, "decode feeds exactly the newest token"
        return [self.output_ids[-1]]

    def stats(self) -> RequestStats:
        assert self.state is RequestState.FINISHED and self.finish_reason is not None
        first = self.first_token_at or self.finished_at
        scheduled = self.scheduled_at or self.finished_at
        return RequestStats(
            request_id=self.request_id,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            queue_time=scheduled - self.arrival,
            prefill_time=first - scheduled,
            decode_time=self.finished_at - first,
            ttft=first - self.arrival,
            e2e=self.finished_at - self.arrival,
            **(self.mm.phase_times() if self.mm is not None else {}),
        )
