"""Run one scenario: warm up, open the window, send on schedule, close, summarise.

The window is timed from the first send to the last completion.  Prometheus histograms
are scraped right before and after it, so the server's per-phase numbers cover the same
requests as the client's.  A server that dies inside the window (seen through the
target's ``check_alive()``; ``guard.py``) turns the run into a failed result that carries
the log tail and what the window measured until then; the caller keeps whatever earlier
runs produced.  Each finished request is appended to ``<result>.requests.jsonl`` at once,
so even a killed run leaves its measurements behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from infra_agent.errors import ConfigError, TargetError
from infra_agent.serving import prom
from infra_agent.serving.arrivals import arrival_offsets, paced
from infra_agent.serving.client import (
    RequestInput,
    RequestOptions,
    RequestRecord,
    make_http_client,
    send_request,
)
from infra_agent.serving.datasets import (
    HFTokenizer,
    Tokenizer,
    build_requests,
    load_tokenizer,
    tokenizer_id,
)
from infra_agent.serving.dead_server import RefusalStreak
from infra_agent.serving.guard import AliveCheck, failed_if_died, run_guarded
from infra_agent.serving.metrics import DEFAULT_PERCENTILES, SLO, compute_metrics
from infra_agent.serving.progress import BenchProgress
from infra_agent.serving.results import (
    RequestLog,
    backend_name,
    environment_info,
    redacted,
    requests_path_for,
    workspace_record,
    write_result,
)
from infra_agent.serving.timing import LatencyDefinition
from infra_agent.serving.tokenizer_check import check_with_tokenize, check_with_usage
from infra_agent.target import open_target
from infra_agent.target.auth import secrets_of
from infra_agent.workspace.models import Scenario, Workspace

_UNFINISHED = "not finished: the run ended before the answer did"
# A request the window did not send, or gave up on, once its server had gone (serving/dead_server.py).
STOPPED_BEFORE_AN_ANSWER = "stopped before an answer"


def _options(scenario: Scenario, model: str, headers: Mapping[str, str] | None = None) -> RequestOptions:
    return RequestOptions(endpoint=scenario.endpoint, model=model, temperature=scenario.temperature, ignore_eos=scenario.ignore_eos,
                          headers=tuple((headers or {}).items()))


def _same_origin(url: str, base_url: str) -> bool:
    a, b = urlsplit(url), urlsplit(base_url)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


async def _discover_model(client: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str] | None = None) -> str:
    """The first model id from /v1/models; servers that do not list models get 'default'."""
    try:
        async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            data = (await resp.json(content_type=None))["data"]
        return str(data[0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _raise_if_unusable(rec: RequestRecord, base_url: str, redact: Callable[[Any], Any] = lambda x: x) -> None:
    """Turn a failed preflight into a message about the target, not about one request."""
    if rec.success or rec.error_kind == "empty":
        return  # an answer without text is still an OpenAI stream; the window counts such failures
    error = redact(rec.error)
    if rec.error_kind == "connect":
        raise TargetError(f"cannot reach {base_url}: is the server running and is the URL right? ({error})")
    if rec.error_kind == "protocol":
        raise TargetError(f"{base_url} does not behave like an OpenAI-compatible streaming server: {error}")
    if rec.error_kind == "http" and error.startswith("HTTP 404 "):
        # The usual cause: a base URL ending in /v1, so requests went to /v1/v1/...
        raise TargetError(f"{base_url} answered HTTP 404 to the first request: the URL must be the server's base "
                          f"URL without /v1 (requests go to <base>/v1/completions or /v1/chat/completions), and the "
                          f"server must serve that OpenAI endpoint ({error})")
    if rec.error_kind == "http" and error.startswith(("HTTP 401 ", "HTTP 403 ")):
        raise TargetError(f"{base_url} refused the request ({error.split(' from ', 1)[0]}): does it need an API key "
                          f"(--api-key-env NAME, or api_key_env in the target) or other headers (--header)? ({error})")
    raise TargetError(f"the first request to {base_url} failed: {error}")


@dataclasses.dataclass
class _Run:
    """What a run has measured so far: enough to write a result whenever it stops."""

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
        result.update(_header(self.base_url, self.scenario, self.model or "default", self.tokenizer, self.headers))
        if self.tokenizer_check is not None:
            result["tokenizer_check"] = self.tokenizer_check
        if self.cpu_start is not None:
            cpu = (self.cpu_end if self.cpu_end is not None else time.process_time()) - self.cpu_start
            result["client_cpu_s"] = cpu
            result["client_cpu_share"] = cpu / max(end - self.window_start, 1e-9)
        if self.stopped:  # check_failed_fraction turns it into the run's error, unless a more specific one comes first
            result["stopped"] = f"{self.stopped} after {sum(r is not None for r in self.records)} of {len(records)} requests"
        if self.server_metrics_error:
            # /metrics answered before the window and not after it: the server went away
            # or stopped answering, so the window's numbers are not to be trusted alone.
            result["server_metrics_error"] = self.server_metrics_error
            result["ok"] = False
            failed = int(result["failed"])
            lost = f"{failed} of {len(records)} requests failed and " if failed else ""
            result["error"] = f"{lost}the server's metrics could not be scraped {self.server_metrics_error}"
        return result


async def _window(client: aiohttp.ClientSession, run: _Run, opts: RequestOptions, progress: bool) -> None:
    scenario, reqs = run.scenario, run.reqs
    sem = asyncio.Semaphore(scenario.max_concurrency) if scenario.max_concurrency else None
    offsets = arrival_offsets(len(reqs), scenario.request_rate, scenario.burstiness, seed=_arrival_seed(scenario))
    run.records = [None] * len(reqs)

    async with BenchProgress(len(reqs), progress) as bar:

        refusals = RefusalStreak()
        tasks: list[asyncio.Task[None]] = []

        async def one(i: int) -> None:
            if sem is None:
                rec = await send_request(client, run.base_url, reqs[i], opts)
            else:
                async with sem:
                    rec = await send_request(client, run.base_url, reqs[i], opts)
            run.finished(i, rec)
            bar.advance(rec)
            if refusals.see(rec):  # the server is gone: what is queued or in flight is not sent
                run.stopped = refusals.reason()
                for t in tasks:
                    if t is not asyncio.current_task():
                        t.cancel()

        run.window_start = time.perf_counter()
        run.cpu_start = time.process_time()
        try:
            async for i in paced(offsets):
                if run.stopped:
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
        run.window_end = time.perf_counter()
        run.cpu_end = time.process_time()
        if run.stopped:  # every request keeps its record (and its line in the requests file)
            for i, rec in enumerate(run.records):
                if rec is None:
                    run.finished(i, RequestRecord(prompt_len=reqs[i].prompt_len, error=f"{STOPPED_BEFORE_AN_ANSWER}: "
                                                  f"{run.stopped}", error_kind="other"))
    assert all(r is not None for r in run.records)


def _arrival_seed(scenario: Scenario) -> int:
    return int(getattr(scenario.dataset, "seed", 0))


async def _measure(run: _Run, metrics_url: str | None, progress: bool, redact: Callable[[Any], Any]) -> dict[str, Any]:
    scenario, base_url, headers = run.scenario, run.base_url, run.headers or None
    warm_n = max(1, scenario.warmup_requests)  # at least one: it doubles as the reachability check
    run.reqs = build_requests(scenario.dataset, scenario.num_requests, run.tokenizer)
    warm = build_requests(scenario.dataset, warm_n, run.tokenizer, seed_offset=1_000_003)
    if scenario.warmup_requests == 0:
        # No warm-up asked for: the check only has to see two streamed tokens.  A judge
        # repeats short runs on a warm server, and a full-length check request was a
        # quarter of each run's wall time there.
        warm[0] = dataclasses.replace(warm[0], output_len=min(2, warm[0].output_len))
    # Credentials go to the metrics URL only when it is the server's own origin.
    metrics_headers = headers if metrics_url and _same_origin(metrics_url, base_url) else None
    concurrency = scenario.max_concurrency or scenario.num_requests
    async with make_http_client(max(concurrency, warm_n)) as client, make_http_client(2, timeout_s=30.0) as side:
        run.model = run.model or await _discover_model(side, base_url, headers)
        opts = _options(scenario, run.model, headers)
        hf = run.tokenizer if isinstance(run.tokenizer, HFTokenizer) else None
        if hf is not None:
            # Before any generation request: a tokenizer that does not fit the server
            # would give every prompt a wrong length.
            run.tokenizer_check = await check_with_tokenize(side, base_url, run.model, hf, warm[0].prompt, headers)
        first = await send_request(client, base_url, warm[0], opts)
        _raise_if_unusable(first, base_url, redact)
        if hf is not None and run.tokenizer_check is None:
            run.tokenizer_check = check_with_usage(hf, base_url, scenario.endpoint, warm[0].prompt, first)
        if warm_n > 1:
            await asyncio.gather(*(send_request(client, base_url, r, opts) for r in warm[1:]))
        run.before = await prom.scrape(side, metrics_url, metrics_headers) if metrics_url else None
        await _window(client, run, opts, progress)
        if metrics_url:
            try:
                run.after = await prom.scrape(side, metrics_url, metrics_headers)
            except TargetError as exc:
                # The window's own numbers stand; only the server's side of it is missing.
                run.server_metrics_error = f"after the window: {exc}"
    return run.result()


async def run_benchmark_async(
    base_url: str,
    scenario: Scenario,
    *,
    model: str | None = None,
    metrics_url: str | None = None,
    progress: bool = True,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    tokenizer: Tokenizer | None = None,
    headers: Mapping[str, str] | None = None,
    latency_definition: LatencyDefinition = "vllm",
) -> dict[str, Any]:
    """The window itself (see ``run_benchmark``); no server watchdog."""
    run = _Run(base_url, scenario, percentiles, tokenizer, dict(headers or {}), model=model,
               latency_definition=latency_definition)
    return await _measure(run, metrics_url, progress, redacted(secrets_of(run.headers)))


def _header(base_url: str, scenario: Scenario, model: str, tokenizer: Tokenizer | None = None,
            headers: Mapping[str, str] | None = None) -> dict[str, Any]:
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
    if headers:
        header["request_headers"] = sorted(headers)  # names only: values may be credentials
    return header


def check_failed_fraction(result: dict[str, Any], max_failed_fraction: float | None) -> dict[str, Any]:
    """Mark a run failed (``ok: false`` with the reason) when too many of its requests failed,
    or when it stopped sending because the server went away (``stopped``)."""
    stopped = result.get("stopped")
    if max_failed_fraction is not None and "failed" in result:
        result["max_failed_fraction"] = max_failed_fraction
        failed, total = int(result["failed"]), int(result["failed"]) + int(result.get("completed", 0))
        if result.get("ok", True) and total and failed / total > max_failed_fraction:
            first = next((e for e in result.get("errors", []) if e), "")
            result["ok"] = False
            result["error"] = (f"{failed} of {total} requests failed ({failed / total:.1%}), more than the "
                               f"{max_failed_fraction:g} allowed (--max-failed-fraction); first error: {first}"
                               + (f"; {stopped}" if stopped else ""))
    if stopped and result.get("ok", True):
        result["ok"], result["error"] = False, stopped
    return result


def run_benchmark(
    base_url: str,
    scenario: Scenario,
    *,
    model: str | None = None,
    metrics_url: str | None = None,
    alive_check: AliveCheck | None = None,
    progress: bool = True,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    tokenizer: Tokenizer | None = None,
    output: str | Path | None = None,
    headers: Mapping[str, str] | None = None,
    requests_path: str | Path | None = None,
    max_failed_fraction: float | None = None,
    latency_definition: LatencyDefinition = "vllm",
) -> dict[str, Any]:
    """One measured window against an OpenAI-compatible ``base_url`` (no ``/v1``).

    Raises ``TargetError`` when the server cannot be reached or does not speak the
    protocol; returns ``{"ok": False, ...}`` when ``alive_check`` reports that the server
    died mid-run, or when more than ``max_failed_fraction`` of the requests failed
    (None: no limit).  ``headers`` go with every request (values never reach the
    result).  Each finished request is appended to ``requests_path`` (by default
    ``<output>.requests.jsonl`` when ``output`` is given).  Writes the result JSON to
    ``output`` when given.  ``latency_definition`` picks what the latency keys mean
    (``timing.py``); the other definition is reported beside them.
    """
    hdrs = dict(headers or {})
    redact = redacted(secrets_of(hdrs))
    if requests_path is None and output is not None:
        requests_path = requests_path_for(output)
    if tokenizer is None and scenario.tokenizer is not None:
        tokenizer = load_tokenizer(scenario.tokenizer, "scenario.tokenizer")
    run = _Run(base_url, scenario, percentiles, tokenizer, hdrs, model=model, latency_definition=latency_definition)
    run.log = RequestLog(requests_path, redact) if requests_path is not None else None
    try:
        result = asyncio.run(run_guarded(run, lambda: _measure(run, metrics_url, progress, redact), alive_check))
    finally:
        if run.log is not None:
            run.log.close()
    if requests_path is not None:
        result["requests_file"] = str(requests_path)
    result = redact(check_failed_fraction(result, max_failed_fraction))
    if output is not None:
        write_result(result, output)
    return result


def run_on_target(
    target: Any,
    scenario: Scenario,
    *,
    scenario_name: str | None = None,
    knobs: Mapping[str, Any] | None = None,
    progress: bool = True,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    tokenizer: Tokenizer | None = None,
    requests_path: str | Path | None = None,
    max_failed_fraction: float | None = None,
    latency_definition: LatencyDefinition = "vllm",
) -> dict[str, Any]:
    """One window against a running target (``infra_agent.target.base.RunningTarget``).

    A launched server that dies (before or inside the window) gives a failed result
    carrying its log tail instead of an exception, so a caller running several
    windows keeps the ones that finished.  The target's ``request_headers`` (auth),
    when it has them, go with every request.
    """
    headers = getattr(target, "request_headers", None) or {}
    try:
        result = run_benchmark(
            target.url, scenario, model=target.model, metrics_url=target.metrics_url, alive_check=target.check_alive,
            progress=progress, percentiles=percentiles, tokenizer=tokenizer, headers=headers,
            requests_path=requests_path, max_failed_fraction=max_failed_fraction, latency_definition=latency_definition,
        )
    except TargetError:
        result = failed_if_died(target.check_alive)
        if result is None:
            raise
    api_key_env = getattr(getattr(target, "spec", None), "api_key_env", None)
    if api_key_env:
        result["api_key_env"] = api_key_env  # the variable's name, never its value
    result["scenario"] = scenario_name
    result["knobs"] = dict(knobs or {})
    return result


def run_workspace_scenario(
    workspace: Workspace,
    scenario_name: str | None = None,
    knob_overrides: Mapping[str, object] | None = None,
    *,
    scenario: Scenario | None = None,
    log_dir: str | Path | None = None,
    progress: bool = True,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    output: str | Path | None = None,
    requests_path: str | Path | None = None,
    max_failed_fraction: float | None = None,
    owner_token: str | None = None,
    latency_definition: LatencyDefinition = "vllm",
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """Start the workspace's target with the knobs, run one scenario, stop the target.

    ``scenario`` replaces the named one (the CLI uses it for --num-requests etc.).  The
    result records the workspace and its git commit (``workspace``).
    """
    name = scenario_name or only_scenario(workspace)
    sc = scenario or workspace.scenario(name)
    knobs = workspace.resolve_knobs(knob_overrides)
    if requests_path is None and output is not None:
        requests_path = requests_path_for(output)
    logs = Path(log_dir) if log_dir else default_log_dir(workspace)
    if tokenizer is None and sc.tokenizer is not None:
        # Loaded before the launch: a bad tokenizer must not cost a server start.
        tokenizer = load_tokenizer(sc.tokenizer, f"scenarios.{name}.tokenizer", str(workspace.source or workspace.root))
    started = False
    try:
        with open_target(workspace, knobs, logs, owner_token=owner_token) as target:
            started = True
            result = run_on_target(target, sc, scenario_name=name, knobs=knobs, progress=progress,
                                   percentiles=percentiles, tokenizer=tokenizer, requests_path=requests_path,
                                   max_failed_fraction=max_failed_fraction, latency_definition=latency_definition)
    except KeyboardInterrupt:
        if not started:
            # The launch is stopped on the way out; say so, or a Ctrl-C during a long
            # model load ends with no word about the server.
            print(f"bench: interrupted while the target of {workspace.name} was starting; it has been stopped "
                  f"(server logs in {logs})", file=sys.stderr, flush=True)
        raise
    result["workspace"] = workspace_record(workspace)
    if output is not None:
        write_result(result, output)
    return result


def only_scenario(workspace: Workspace) -> str:
    if len(workspace.scenarios) != 1:
        raise ConfigError(str(workspace.source or "<workspace>"), "scenarios",
                          "a --scenario name (the workspace has several)" if workspace.scenarios else "at least one scenario",
                          sorted(workspace.scenarios))
    return next(iter(workspace.scenarios))


def default_log_dir(workspace: Workspace) -> Path:
    return workspace.root / ".infra-agent" / "logs"
