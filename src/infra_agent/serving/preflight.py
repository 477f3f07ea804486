"""Before a window: which model the server serves, and whether it can be measured at all.

The first request of a run doubles as the reachability check.  Its failure says
something about the target (wrong URL, no OpenAI streaming, an API key it wants), not
about one request, so it is turned into a ``TargetError`` a person can act on instead of
a window of identical failures.  Apart from the runner because these are questions
asked once per run, with their own messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from infra_agent.errors import TargetError
from infra_agent.serving.client import RequestRecord


async def discover_model(client: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str] | None = None) -> str:
    """The first model id from /v1/models; servers that do not list models get 'default'."""
    try:
        async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            data = (await resp.json(content_type=None))["data"]
        return str(data[0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def raise_if_unusable(rec: RequestRecord, base_url: str, redact: Callable[[Any], Any] = lambda x: x) -> None:
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
