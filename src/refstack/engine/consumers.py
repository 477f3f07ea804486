"""How results leave the engine: an asyncio stream per request, or a blocking batch run.

Both adapt the engine's per-request sink, which is called on the engine thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from refstack.engine.request import RequestOutput, Sink
from refstack.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from refstack.engine.engine import Engine


class RequestStream:
    """The asyncio side of one request: deltas arrive from the engine thread by
    ``call_soon_threadsafe``; ``abort()`` (safe to call twice) frees its slot early."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.request_id = ""
        self.finished = False

    def sink(self, out: RequestOutput) -> None:  # runs on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:
            pass  # the event loop is closed: the consumer is gone, nothing to deliver to

    async def get(self) -> RequestOutput:
        out = await self._queue.get()
        self.finished = out.finished
        return out

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


def run_to_completion(engine: Engine, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
    """Submit every prompt, wait for all, return one merged output per prompt in order."""
    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    assert len(plist) == len(prompts)
    results: list[list[RequestOutput]] = [[] for _ in prompts]
    done = threading.Event()
    remaining = [len(prompts)]
    guard = threading.Lock()

    def make_sink(i: int) -> Sink:
        def sink(out: RequestOutput) -> None:  # runs on the engine thread (or here)
            results[i].append(out)
            if out.finished:
                with guard:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set()
        return sink

    for i, (prompt, p) in enumerate(zip(prompts, plist)):
        engine.add_request(prompt, p, make_sink(i))
    if not prompts:
        return []
    if not engine.is_running:
        while not done.is_set():
            engine.step()
    done.wait()
    return [_merge(r) for r in results]


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    last = outs[-1]
    assert last.finished
    return RequestOutput(last.request_id, "".join(o.text for o in outs),
                         tuple(t for o in outs for t in o.token_ids), True, last.finish_reason,
                         last.prompt_tokens, last.completion_tokens)

