"""What the prefill and the decode worker's engines share: an engine whose requests report
to the front end through ``send`` (see ``worker``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from refstack.engine import EngineConfig
from refstack.engine.request import Request, RequestOutput
from refstack.engine.sampling import SamplingParams
from refstack.server.logprobs import LogprobEngine, LogprobParams

Send = Callable[[tuple[Any, ...]], None]


def generator_state(gen: torch.Generator) -> bytes:
    return gen.get_state().numpy().tobytes()


class WorkerEngine(LogprobEngine):
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
