"""Continuous batching with chunked prefill over a fixed pool of cache slots.

Each step spends a token budget (``max_batch_tokens``):

1. every running request past its prefill gets one decode token, oldest first --
   decodes go first so that inter-token latency does not grow with the queue;
2. running requests still in prefill get their next piece (``prefill_chunk`` at most);
3. waiting requests are admitted, while a slot is free, fewer than ``max_running``
   run and budget is left; each starts its prefill in the same step.

A slot holds one request's KV cache rows and its KDA recurrent state; it is taken at
admission and given back when the request finishes or is aborted.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from refstack.engine.config import EngineConfig
from refstack.engine.request import Request, RequestState


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: Request
    token_ids: list[int]
    start_pos: int

    @property
    def completes_prefill(self) -> bool:
        """True when the model's logits after this chunk give the request's next token."""
        return self.start_pos + len(self.token_ids) == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    decode: list[ScheduledChunk] = field(default_factory=list)
    prefill: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # took a slot this step

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(len(c.token_ids) for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, config: EngineConfig, num_slots: int) -> None:
        self.config = config
        self.num_slots = num_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Lowest slot first, so a given arrival order always maps to the same slots.
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_slots_used(self) -> int:
        return self.num_slots - len(self._free_slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        assert request.state is RequestState.WAITING
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_batch_tokens
        for req in self.running:
            if budget == 0:
                break
            if not req.in_prefill:
                out.decode.append(ScheduledChunk(req, req.next_chunk(1), req.num_computed))
                budget -= 1
        for req in self.running:
            if budget == 0:
                break
            if req.in_prefill:
                budget -= self._schedule_prefill(req, budget, out)
        limit = min(self.config.max_running, self.num_slots)
        while self.waiting and budget > 0 and self._free_slots and len(self.running) < limit:
            req = self.waiting.popleft()
            req.slot = self._free_slots.pop()
            req.state = RequestState.RUNNING
            req.scheduled_at = time.monotonic()
            self.running.append(req)
            out.admitted.append(req)
            budget -= self._schedule_prefill(req, budget, out)
        assert out.num_tokens <= self.config.max_batch_tokens
        return out

    def _schedule_prefill(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        tokens = req.next_chunk(min(budget, self.config.prefill_chunk))
        out.prefill.append(ScheduledChunk(req, tokens, req.num_computed))
        return len(tokens)

    def finish(self, req: Request) -> None:
        """Take a running request out and give its slot back."""
        self.running.remove(req)
        self._release(req)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; None if it is not here (already finished)."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req)
                return req
        return None

    def _release(self, req: Request) -> None:
        assert req.slot >= 0 and req.slot not in self._free_slots
        self._free_slots.append(req.slot)
        # Keep the pool sorted descending so pop() hands out the lowest slot.
        self._free_slots.sort(reverse=True)
        req.slot = -1
