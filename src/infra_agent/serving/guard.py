"""Guarding a run against the server dying: a watchdog on the target's liveness check.

A run whose server dies becomes a failed result that carries the server's log tail and
what the window measured until then, instead of an exception.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from infra_agent.errors import InfraAgentError, ServerStartError
from infra_agent.serving.results import failed_result

if TYPE_CHECKING:
    from infra_agent.serving.window import MeasuredWindow

AliveCheck = Callable[[], None]  # raises ServerStartError when the server is gone
_ALIVE_POLL_S = 0.25


async def _watch(alive: AliveCheck) -> None:
    """Return as soon as ``alive()`` reports the server gone."""
    while True:
        try:
            alive()
        except ServerStartError:
            return
        await asyncio.sleep(_ALIVE_POLL_S)


async def run_guarded(run: MeasuredWindow, coro_factory: Callable[[], Any], alive_check: AliveCheck | None) -> dict[str, Any]:
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
        failed = failed_if_died(alive_check, run.result() if run.window_start is not None else None)
        if failed is None:
            raise
        return failed
    # Requests to a dead server fail fast, so the window can end before the watchdog's
    # next poll: ask once more before trusting the numbers (with the grace when some
    # requests failed, the sign of a server going away).
    suspicious = result.get("failed") or result.get("server_metrics_error")
    failed = failed_if_died(alive_check, result, grace_s=_DEATH_GRACE_S if suspicious else 0.0)
    return failed if failed is not None else result


# A crashing process closes its sockets before the kernel lets its parent reap it, so a
# client can see "connection refused" while poll() still says the process runs.  After an
# error, wait this long for the exit to become visible before calling the error a
# protocol or network problem.
_DEATH_GRACE_S = 2.0


def _dead(alive_check: AliveCheck, grace_s: float = 0.0) -> ServerStartError | None:
    """The error ``alive_check`` raises once the server is gone, waiting up to ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            alive_check()
        except ServerStartError as err:
            return err
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _died(err: ServerStartError, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """A failed result for a server that died, keeping what the window measured."""
    # The error's text repeats the log path and tail; those have their own keys.
    reason = str(err).split("\n", 1)[0]
    failed = failed_result(f"server died during the run: {reason}", err.log_tail, err.log_path)
    if measured is None:
        return failed
    return {**measured, **failed}


def failed_if_died(alive_check: AliveCheck, measured: dict[str, Any] | None = None,
                   grace_s: float = _DEATH_GRACE_S) -> dict[str, Any] | None:
    """The failed result of a server that died (keeping ``measured``), or None while it lives.

    Called after an error or a suspicious window: None tells the caller the error was not
    the server's death, so it re-raises or keeps its result."""
    died = _dead(alive_check, grace_s=grace_s)
    return _died(died, measured) if died is not None else None
