"""``MeasuredWindow``: one measured window, sent on its schedule and summarised whenever it stops.

The window is timed from the first send to the last completion, and the client's own
CPU time is taken over the same span.  It is apart from the runner (which warms the
server up, scrapes its metrics around the window and writes the result) because it is
the part a dead server cuts short: ``result()`` holds at any moment, requests still in
flight counting as failed, and ``send()`` stops sending once the server refuses
connections (``dead_server.RefusalStreak``), every unanswered request keeping a record
(and its line in the requests file) that says why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

import aiohttp

from infra_agent.serving import prom
from infra_agent.serving.arrivals import arrival_offsets, paced
from infra_agent.serving.client import (
    RequestInput,
    RequestOptions,
    RequestRecord,
    send_request,
)
from infra_agent.serving.datasets import Tokenizer, tokenizer_id
from infra_agent.serving.dead_server import RefusalStreak
from infra_agent.serving.metrics import SLO, compute_metrics
from infra_agent.serving.progress import BenchProgress
from infra_agent.serving.results import RequestLog, backend_name, environment_info
from infra_agent.serving.timing import LatencyDefinition
from infra_agent.workspace.models import Scenario

_UNFINISHED = "not finished: the run ended before the answer did"
# A request the window did not send, or gave up on, once its server had gone (serving/dead_server.py).
STOPPED_BEFORE_AN_ANSWER = "stopped before an answer"


@dataclasses.dataclass
class MeasuredWindow:
    """What a window has measured so far: enough to write a result whenever it stops."""

    base_url: str
    scenario: Scenario
    percentiles: Sequence[float]
    tokenizer: Tokenizer | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    log: RequestLog | None = None
    model: str | None = None
    reqs: list[RequestInput] = dataclasses.field(default_factory=list)
    records: list[RequestRecord | None] = dataclasses.field(default_factory=list)
    window_start: float | None = None
    window_end: float | None = None
    # The client's own CPU time over the window: a load generator that saturates its
    # core delivers chunks late and in bursts, and its latencies measure itself.
    cpu_start: float | None = None
    cpu_end: float | None = None
    before: prom.Snapshot | None = None
    after: prom.Snapshot | None = None
    server_metrics_error: str | None = None
    latency_definition: LatencyDefinition = "vllm"
    # How the tokenizer was checked against the server (tokenizer_check.py); None: not checked.
    tokenizer_check: str | None = None
    # Why the window stopped sending before its last request (serving/dead_server.py), if it did.
    stopped: str | None = None
    # Which prompt set the window draws (serving/prompt_sets.py; None: the dataset's own),
    # and the record of what was drawn, for the result.
    prompt_set: int | None = None
    prompts: dict[str, Any] | None = None
    # Connections opened before the window beyond the warm-up's (client.preopen_connections).
    preopened: int | None = None

    def finished(self, i: int, rec: RequestRecord) -> None:
        self.records[i] = rec
        if self.log is not None and self.window_start is not None:
            self.log.write(i, rec, self.window_start)

    def result(self) -> dict[str, Any]:
        """The result of the window so far; requests still in flight count as failed."""
        assert self.window_start is not None, "the window has not started"
        records = [r if r is not None else RequestRecord(prompt_len=q.prompt_len, error=_UNFINISHED, error_kind="other")
                   for r, q in zip(self.records, self.reqs)]
        end = self.window_end if self.window_end is not None else time.perf_counter()
        slo = SLO(**self.scenario.slo.model_dump()) if self.scenario.slo else None
        result = compute_metrics(records, max(end - self.window_start, 1e-9), percentiles=self.percentiles, slo=slo,
                                 definition=self.latency_definition)
        if self.before is not None and self.after is not None:
            result["server_metrics"] = prom.phase_deltas(self.before, self.after)
        else:
            result["server_metrics"] = None
        result.update(result_header(self.base_url, self.scenario, self.model or "default", self.tokenizer, self.headers))
        if self.tokenizer_check is not None:
            result["tokenizer_check"] = self.tokenizer_check
        if self.prompts is not None:
            result["prompts"] = self.prompts
        if self.preopened is not None:
            result["connections_preopened"] = self.preopened
        if self.cpu_start is not None:
            cpu = (self.cpu_end if self.cpu_end is not None else time.process_time()) - self.cpu_start
            result["client_cpu_s"] = cpu
            result["client_cpu_share"] = cpu / max(end - self.window_start, 1e-9)
        if self.stopped:  # check_failed_fraction turns it into the run's error, unless a more specific one comes first
            # Those that had an answer (or an error) when it stopped; the rest carry STOPPED_BEFORE_AN_ANSWER.
            ended = sum(r is not None and not r.error.startswith(STOPPED_BEFORE_AN_ANSWER) for r in self.records)
            result["stopped"] = f"{self.stopped} after {ended} of {len(records)} requests"
        if self.server_metrics_error:
            # /metrics answered before the window and not after it: the server went away
            # or stopped answering, so the window's numbers are not to be trusted alone.
            result["server_metrics_error"] = self.server_metrics_error
            result["ok"] = False
            failed = int(result["failed"])
            lost = f"{failed} of {len(records)} requests failed and " if failed else ""
            result["error"] = f"{lost}the server's metrics could not be scraped {self.server_metrics_error}"
        return result

    async def send(self, client: aiohttp.ClientSession, opts: RequestOptions, progress: bool) -> None:
        """Send every request on its schedule, and stop sending once the server refuses connections."""
        scenario, reqs = self.scenario, self.reqs
        sem = asyncio.Semaphore(scenario.max_concurrency) if scenario.max_concurrency else None
        offsets = arrival_offsets(len(reqs), scenario.request_rate, scenario.burstiness, seed=_arrival_seed(scenario))
        self.records = [None] * len(reqs)

        async with BenchProgress(len(reqs), progress) as bar:

            refusals = RefusalStreak()
            tasks: list[asyncio.Task[None]] = []

            async def one(i: int) -> None:
                if sem is None:
                    rec = await send_request(client, self.base_url, reqs[i], opts)
                else:
                    async with sem:
                        rec = await send_request(client, self.base_url, reqs[i], opts)
                self.finished(i, rec)
                bar.advance(rec)
                if refusals.see(rec):  # the server is gone: what is queued or in flight is not sent
                    self.stopped = refusals.reason()
                    for t in tasks:
                        if t is not asyncio.current_task():
                            t.cancel()

            self.window_start = time.perf_counter()
            self.cpu_start = time.process_time()
            try:
                async for i in paced(offsets):
                    if self.stopped:
                        break
                    tasks.append(asyncio.create_task(one(i)))
                # Tasks the refusal streak cancelled end as CancelledError: not an error of the window's.
                outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
                if errors:
                    raise errors[0]
            finally:
                for t in tasks:
                    t.cancel()
            self.window_end = time.perf_counter()
            self.cpu_end = time.process_time()
            if self.stopped:  # every request keeps its record (and its line in the requests file)
                for i, rec in enumerate(self.records):
                    if rec is None:
                        self.finished(i, RequestRecord(prompt_len=reqs[i].prompt_len, error=f"{STOPPED_BEFORE_AN_ANSWER}: "
                                                      f"{self.stopped}", error_kind="other"))
        assert all(r is not None for r in self.records)


def _arrival_seed(scenario: Scenario) -> int:
    return int(getattr(scenario.dataset, "seed", 0))


def result_header(base_url: str, scenario: Scenario, model: str, tokenizer: Tokenizer | None = None,
                  headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keys every result opens with: when, against what, with which workload."""
    rate = scenario.request_rate
    header: dict[str, Any] = {
        "ok": True,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": backend_name(scenario.endpoint),
        "url": base_url,
        "model_id": model,
        "tokenizer_id": tokenizer_id(tokenizer),
        "endpoint": scenario.endpoint,
        "num_prompts": scenario.num_requests,
        "max_concurrency": scenario.max_concurrency,
        # JSON has no infinity; vLLM writes the string "inf" too.
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": "inf" if math.isinf(scenario.burstiness) else scenario.burstiness,
        "dataset": scenario.dataset.model_dump(mode="json"),
        "environment": environment_info(),
    }
    # What the requests asked for, so a comparison with another client's numbers can see it
    # (vLLM's client sends no temperature: the server's default, 1.0 unless the model's
    # generation config says otherwise; ours sends 0 unless the scenario says so).
    header["sampling"] = {"temperature": "server default" if scenario.temperature is None else scenario.temperature,
                          "ignore_eos": scenario.ignore_eos}
    if headers:
        header["request_headers"] = sorted(headers)  # names only: values may be credentials
    return header
