"""Run one scenario: warm up, open the window, send on schedule, close, summarise.

The window is timed from the first send to the last completion.  Prometheus histograms
are scraped right before and after it, so the server's per-phase numbers cover the same
requests as the client's.  A server that dies inside the window (seen through the
target's ``check_alive()``) turns the run into a failed result that carries the log
tail; the caller keeps whatever earlier runs produced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from infra_agent.bench import prom
from infra_agent.bench.arrivals import arrival_offsets, paced
from infra_agent.bench.client import (
    RequestInput,
    RequestOptions,
    RequestRecord,
    make_http_client,
    send_request,
)
from infra_agent.bench.datasets import Tokenizer, build_requests
from infra_agent.bench.metrics import DEFAULT_PERCENTILES, SLO, compute_metrics
from infra_agent.bench.results import failed_result, write_result
from infra_agent.errors import (
    ConfigError,
    InfraAgentError,
    ServerStartError,
    TargetError,
)
from infra_agent.target import open_target
from infra_agent.workspace.models import Scenario, Workspace

AliveCheck = Callable[[], None]  # raises ServerStartError when the server is gone
_ALIVE_POLL_S = 0.25


def _options(scenario: Scenario, model: str) -> RequestOptions:
    return RequestOptions(endpoint=scenario.endpoint, model=model, temperature=scenario.temperature, ignore_eos=scenario.ignore_eos)


async def _discover_model(client: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id from /v1/models; servers that do not list models get 'default'."""
    try:
        async with client.get(base_url.rstrip("/") + "/v1/models") as resp:
            data = (await resp.json(content_type=None))["data"]
        return str(data[0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _raise_if_unusable(rec: RequestRecord, base_url: str) -> None:
    """Turn a failed preflight into a message about the target, not about one request."""
    if rec.success or rec.error_kind == "empty":
        return  # an answer without text is still an OpenAI stream; the window counts such failures
    if rec.error_kind == "connect":
        raise TargetError(f"cannot reach {base_url}: is the server running and is the URL right? ({rec.error})")
    if rec.error_kind == "protocol":
        raise TargetError(f"{base_url} does not behave like an OpenAI-compatible streaming server: {rec.error}")
    raise TargetError(f"the first request to {base_url} failed: {rec.error}")


async def _watch(alive: AliveCheck) -> None:
    """Return as soon as ``alive()`` reports the server gone."""
    while True:
        try:
            alive()
        except ServerStartError:
            return
        await asyncio.sleep(_ALIVE_POLL_S)


async def _window(
    client: aiohttp.ClientSession, base_url: str, reqs: Sequence[RequestInput], scenario: Scenario, opts: RequestOptions, progress: bool
) -> tuple[list[RequestRecord], float]:
    sem = asyncio.Semaphore(scenario.max_concurrency) if scenario.max_concurrency else None
    offsets = arrival_offsets(len(reqs), scenario.request_rate, scenario.burstiness, seed=_arrival_seed(scenario))
    records: list[RequestRecord | None] = [None] * len(reqs)
    bar = Progress(
        TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, disable=not progress,
    )
    task_id = bar.add_task("requests", total=len(reqs))

    async def one(i: int) -> None:
        if sem is None:
            records[i] = await send_request(client, base_url, reqs[i], opts)
        else:
            async with sem:
                records[i] = await send_request(client, base_url, reqs[i], opts)
        bar.advance(task_id)

    with bar:
        start = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) async for i in paced(offsets)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        duration = time.perf_counter() - start
    assert all(r is not None for r in records)
    return [r for r in records if r is not None], duration


def _arrival_seed(scenario: Scenario) -> int:
    return int(getattr(scenario.dataset, "seed", 0))


async def run_benchmark_async(
    base_url: str,
    scenario: Scenario,
    *,
    model: str | None = None,
    metrics_url: str | None = None,
    progress: bool = True,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """The window itself (see ``run_benchmark``); no server watchdog."""
    warm_n = max(1, scenario.warmup_requests)  # at least one: it doubles as the reachability check
    reqs = build_requests(scenario.dataset, scenario.num_requests, tokenizer)
    warm = build_requests(scenario.dataset, warm_n, tokenizer, seed_offset=1_000_003)
    if scenario.warmup_requests == 0:
        # No warm-up asked for: the check only has to see two streamed tokens.  A judge
        # repeats short runs on a warm server, and a full-length check request was a
        # quarter of each run's wall time there.
        warm[0] = dataclasses.replace(warm[0], output_len=min(2, warm[0].output_len))
    concurrency = scenario.max_concurrency or scenario.num_requests
    async with make_http_client(max(concurrency, warm_n)) as client, make_http_client(2, timeout_s=30.0) as side:
        model = model or await _discover_model(side, base_url)
        opts = _options(scenario, model)
        first = await send_request(client, base_url, warm[0], opts)
        _raise_if_unusable(first, base_url)
        if warm_n > 1:
            await asyncio.gather(*(send_request(client, base_url, r, opts) for r in warm[1:]))
        before = await prom.scrape(side, metrics_url) if metrics_url else None
        records, duration = await _window(client, base_url, reqs, scenario, opts, progress)
        after = await prom.scrape(side, metrics_url) if metrics_url else None
    slo = SLO(**scenario.slo.model_dump()) if scenario.slo else None
    result = compute_metrics(records, duration, percentiles=percentiles, slo=slo)
    result["server_metrics"] = prom.phase_deltas(before, after) if before is not None and after is not None else None
    result.update(_header(base_url, scenario, model))
    return result


def _header(base_url: str, scenario: Scenario, model: str) -> dict[str, Any]:
    rate = scenario.request_rate
    return {
        "ok": True,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "url": base_url,
        "model_id": model,
        "endpoint": scenario.endpoint,
        "num_prompts": scenario.num_requests,
        "max_concurrency": scenario.max_concurrency,
        # JSON has no infinity; vLLM writes the string "inf" too.
        "request_rate": "inf" if math.isinf(rate) else rate,
        "burstiness": "inf" if math.isinf(scenario.burstiness) else scenario.burstiness,
        "dataset": scenario.dataset.model_dump(mode="json"),
    }


async def _run_guarded(coro_factory: Callable[[], Any], alive_check: AliveCheck | None) -> dict[str, Any]:
    if alive_check is None:
        return await coro_factory()
    main = asyncio.create_task(coro_factory())
    watch = asyncio.create_task(_watch(alive_check))
    await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if not main.done():
        main.cancel()
    try:
        result: dict[str, Any] = await main
    except (asyncio.CancelledError, InfraAgentError):
        died = _death(alive_check, grace_s=_DEATH_GRACE_S)
        if died is None:
            raise
        return died
    # Requests to a dead server fail fast, so the window can end before the watchdog's
    # next poll: ask once more before trusting the numbers (with the grace when some
    # requests failed, the sign of a server going away).
    return _death(alive_check, grace_s=_DEATH_GRACE_S if result.get("failed") else 0.0) or result


# A crashing process closes its sockets before the kernel lets its parent reap it, so a
# client can see "connection refused" while poll() still says the process runs.  After an
# error, wait this long for the exit to become visible before calling the error a
# protocol or network problem.
_DEATH_GRACE_S = 2.0


def _death(alive_check: AliveCheck, grace_s: float = 0.0) -> dict[str, Any] | None:
    deadline = time.monotonic() + grace_s
    while True:
        try:
            alive_check()
        except ServerStartError as err:
            return failed_result(f"server died during the run: {err.args[0] if err.args else err}", err.log_tail, err.log_path)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


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
) -> dict[str, Any]:
    """One measured window against an OpenAI-compatible ``base_url`` (no ``/v1``).

    Raises ``TargetError`` when the server cannot be reached or does not speak the
    protocol; returns ``{"ok": False, ...}`` when ``alive_check`` reports that the server
    died mid-run.  Writes the result JSON to ``output`` when given.
    """
    result = asyncio.run(
        _run_guarded(
            lambda: run_benchmark_async(
                base_url, scenario, model=model, metrics_url=metrics_url, progress=progress,
                percentiles=percentiles, tokenizer=tokenizer,
            ),
            alive_check,
        )
    )
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
) -> dict[str, Any]:
    """One window against a running target (``infra_agent.target.base.RunningTarget``).

    A launched server that dies (before or inside the window) gives a failed result
    carrying its log tail instead of an exception, so a caller running several
    windows keeps the ones that finished.
    """
    try:
        result = run_benchmark(
            target.url, scenario, model=target.model, metrics_url=target.metrics_url, alive_check=target.check_alive,
            progress=progress, percentiles=percentiles, tokenizer=tokenizer,
        )
    except TargetError:
        died = _death(target.check_alive, grace_s=_DEATH_GRACE_S)
        if died is None:
            raise
        result = died
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
) -> dict[str, Any]:
    """Start the workspace's target with the knobs, run one scenario, stop the target.

    ``scenario`` replaces the named one (the CLI uses it for --num-requests etc.).
    """
    name = scenario_name or only_scenario(workspace)
    sc = scenario or workspace.scenario(name)
    knobs = workspace.resolve_knobs(knob_overrides)
    with open_target(workspace, knobs, Path(log_dir) if log_dir else default_log_dir(workspace)) as target:
        result = run_on_target(target, sc, scenario_name=name, knobs=knobs, progress=progress, percentiles=percentiles)
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
