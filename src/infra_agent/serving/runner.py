"""Run one scenario: warm up, open the window, send on schedule, close, summarise.

The window itself (timing, sending, the stop when the server is gone) is
``window.MeasuredWindow``; the first request's checks are ``preflight.py``.  Prometheus
histograms are scraped right before and after the window, so the server's per-phase
numbers cover the same requests as the client's.  A server that dies inside the window
(seen through the target's ``check_alive()``; ``guard.py``) turns the run into a failed
result that carries the log tail and what the window measured until then; the caller
keeps whatever earlier runs produced.  Each finished request is appended to ``<result>.requests.jsonl`` at once,
so even a killed run leaves its measurements behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from infra_agent.errors import ConfigError, TargetError
from infra_agent.serving import prom
from infra_agent.serving.client import (
    RequestOptions,
    make_http_client,
    preopen_connections,
    send_request,
)
from infra_agent.serving.datasets import HFTokenizer, Tokenizer, load_tokenizer
from infra_agent.serving.guard import AliveCheck, failed_if_died, run_guarded
from infra_agent.serving.metrics import DEFAULT_PERCENTILES
from infra_agent.serving.preflight import discover_model, raise_if_unusable
from infra_agent.serving.prompt_sets import window_prompts
from infra_agent.serving.results import (
    RequestLog,
    redacted,
    requests_path_for,
    workspace_record,
    write_result,
)
from infra_agent.serving.timing import LatencyDefinition
from infra_agent.serving.tokenizer_check import check_with_tokenize, check_with_usage
from infra_agent.serving.window import MeasuredWindow
from infra_agent.target import open_target
from infra_agent.target.auth import secrets_of
from infra_agent.workspace.models import Scenario, Workspace


def _options(scenario: Scenario, model: str, headers: Mapping[str, str] | None = None) -> RequestOptions:
    return RequestOptions(endpoint=scenario.endpoint, model=model, temperature=scenario.temperature, ignore_eos=scenario.ignore_eos,
                          headers=tuple((headers or {}).items()))


def _same_origin(url: str, base_url: str) -> bool:
    a, b = urlsplit(url), urlsplit(base_url)
    return (a.scheme, a.netloc) == (b.scheme, b.netloc)


async def _measure(run: MeasuredWindow, metrics_url: str | None, progress: bool, redact: Callable[[Any], Any]) -> dict[str, Any]:
    scenario, base_url, headers = run.scenario, run.base_url, run.headers or None
    warm_n = max(1, scenario.warmup_requests)  # at least one: it doubles as the reachability check
    # Timed and warm-up prompts of the window's own set: none of them was sent before.
    run.reqs, warm, run.prompts = window_prompts(scenario, warm_n, run.tokenizer, run.prompt_set)
    if scenario.warmup_requests == 0:
        # No warm-up asked for: the check only has to see two streamed tokens.  A judge
        # repeats short runs on a warm server, and a full-length check request was a
        # quarter of each run's wall time there.
        warm[0] = dataclasses.replace(warm[0], output_len=min(2, warm[0].output_len))
    # Credentials go to the metrics URL only when it is the server's own origin.
    metrics_headers = headers if metrics_url and _same_origin(metrics_url, base_url) else None
    concurrency = scenario.max_concurrency or scenario.num_requests
    async with make_http_client(max(concurrency, warm_n)) as client, make_http_client(2, timeout_s=30.0) as side:
        run.model = run.model or await discover_model(side, base_url, headers)
        opts = _options(scenario, run.model, headers)
        hf = run.tokenizer if isinstance(run.tokenizer, HFTokenizer) else None
        if hf is not None:
            # Before any generation request: a tokenizer that does not fit the server
            # would give every prompt a wrong length.
            run.tokenizer_check = await check_with_tokenize(side, base_url, run.model, hf, warm[0].prompt, headers)
        first = await send_request(client, base_url, warm[0], opts)
        raise_if_unusable(first, base_url, redact)
        if hf is not None and run.tokenizer_check is None:
            run.tokenizer_check = check_with_usage(hf, base_url, scenario.endpoint, warm[0].prompt, first)
        if warm_n > 1:
            await asyncio.gather(*(send_request(client, base_url, r, opts) for r in warm[1:]))
        if concurrency > warm_n:
            # The window's first wave must not pay for connects the warm-up did not make.
            run.preopened = await preopen_connections(client, base_url, concurrency, dict(headers or {}))
        run.before = await prom.scrape(side, metrics_url, metrics_headers) if metrics_url else None
        await run.send(client, opts, progress)
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
    prompt_set: int | None = None,
) -> dict[str, Any]:
    """The window itself (see ``run_benchmark``); no server watchdog."""
    run = MeasuredWindow(base_url, scenario, percentiles, tokenizer, dict(headers or {}), model=model,
               latency_definition=latency_definition, prompt_set=prompt_set)
    return await _measure(run, metrics_url, progress, redacted(secrets_of(run.headers)))


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
    prompt_set: int | None = None,
) -> dict[str, Any]:
    """One measured window against an OpenAI-compatible ``base_url`` (no ``/v1``).

    Raises ``TargetError`` when the server cannot be reached or does not speak the
    protocol; returns ``{"ok": False, ...}`` when ``alive_check`` reports that the server
    died mid-run, or when more than ``max_failed_fraction`` of the requests failed
    (None: no limit).  ``headers`` go with every request (values never reach the
    result).  Each finished request is appended to ``requests_path`` (by default
    ``<output>.requests.jsonl`` when ``output`` is given).  Writes the result JSON to
    ``output`` when given.  ``latency_definition`` picks what the latency keys mean
    (``timing.py``); the other definition is reported beside them.  ``prompt_set`` picks the
    window's prompts (``prompt_sets.py``; None: the dataset's own); ``result["prompts"]``
    records the seed they were drawn with.
    """
    hdrs = dict(headers or {})
    redact = redacted(secrets_of(hdrs))
    if requests_path is None and output is not None:
        requests_path = requests_path_for(output)
    if tokenizer is None and scenario.tokenizer is not None:
        tokenizer = load_tokenizer(scenario.tokenizer, "scenario.tokenizer")
    run = MeasuredWindow(base_url, scenario, percentiles, tokenizer, hdrs, model=model, latency_definition=latency_definition,
                         prompt_set=prompt_set)
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
    prompt_set: int | None = None,
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
            prompt_set=prompt_set,
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
