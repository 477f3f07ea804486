"""The chat client of the ``llm`` proposer: one OpenAI-compatible endpoint, errors a person can act on.

- The API key comes from the argument, else ``INFRA_AGENT_API_KEY``, else
  ``OPENAI_API_KEY``; a loopback endpoint needs none (a placeholder is sent).
- HTTP 429 and 5xx are retried here (not in the SDK) with exponential backoff and
  jitter, each wait logged; after ``max_retries`` retries the call fails.
- Every failure becomes an ``InfraAgentError`` naming the endpoint and what to check:
  unreachable, timed out, key refused (401/403, naming the variable), other statuses.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from infra_agent.errors import InfraAgentError
from infra_agent.safety import scrub, secret_values

log = logging.getLogger(__name__)

KEY_ENV_VARS = ("INFRA_AGENT_API_KEY", "OPENAI_API_KEY")
LOOPBACK_PLACEHOLDER_KEY = "no-key-needed-on-loopback"
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class LLMError(InfraAgentError):
    """The LLM endpoint could not be used (unreachable, refused, rate-limited, timed out)."""


def is_loopback(url: str) -> bool:
    host = (urlparse(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def resolve_key(api_key: str | None, base_url: str, environ: dict[str, str] | None = None) -> tuple[str, str]:
    """(key, where it came from): the argument, an environment variable, or the loopback placeholder."""
    env = os.environ if environ is None else environ
    if api_key:
        return api_key, "the api_key argument"
    for var in KEY_ENV_VARS:
        if env.get(var):
            return env[var], var
    if is_loopback(base_url):
        return LOOPBACK_PLACEHOLDER_KEY, "none (loopback endpoint)"
    raise LLMError(f"no API key for the LLM endpoint at {base_url}: set {KEY_ENV_VARS[0]} "
                   f"(or {KEY_ENV_VARS[1]}) in the environment")


@dataclass
class ChatReply:
    message: dict[str, Any]  # the assistant message as plain data (content, tool_calls)
    tokens: int  # total tokens of this call (usage, or an estimate when the server sends none)
    usage_reported: bool
    finish_reason: str | None


class ChatClient:
    """``chat(messages, tools)`` against one endpoint, with retries and clear errors."""

    def __init__(self, model: str, base_url: str, api_key: str | None = None, timeout_s: float = 60.0,
                 max_retries: int = 4, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 temperature: float | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        import openai

        self.model = model
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.temperature = temperature
        self._sleep = sleep
        self._key, self.key_source = resolve_key(api_key, self.base_url)
        # Proxies from the environment are for the world, not for a server on this machine.
        http_client = openai.DefaultHttpxClient(trust_env=False) if is_loopback(self.base_url) else None
        self._client = openai.OpenAI(base_url=self.base_url, api_key=self._key, timeout=timeout_s, max_retries=0,
                                     http_client=http_client)
        self.retries = 0  # retries made over the client's life (for logs and tests)

    @property
    def secrets(self) -> list[str]:
        return [self._key] if self._key != LOOPBACK_PLACEHOLDER_KEY else []

    def close(self) -> None:
        self._client.close()

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> ChatReply:
        import openai

        attempt = 0
        while True:
            try:
                kwargs: dict[str, Any] = {"model": self.model, "messages": messages}
                if tools:
                    kwargs["tools"] = tools
                    kwargs["tool_choice"] = "auto"
                if self.temperature is not None:
                    kwargs["temperature"] = self.temperature
                resp = self._client.chat.completions.create(**kwargs)
                return self._reply(resp, messages)
            except openai.APITimeoutError:
                raise LLMError(f"the LLM endpoint at {self.base_url} did not answer within the timeout of "
                               f"{self.timeout_s:g} s (timeout_s); raise it for a slow model") from None
            except openai.APIConnectionError as exc:
                cause = exc.__cause__ or exc
                raise LLMError(f"cannot reach the LLM endpoint at {self.base_url}: {self._clean(str(cause) or type(cause).__name__)}"
                               " (is the server running, and is the URL right?)") from None
            except openai.APIStatusError as exc:
                status = exc.status_code
                detail = self._clean(_error_text(exc))
                if status in (401, 403):
                    raise LLMError(f"the LLM endpoint at {self.base_url} refused the API key (HTTP {status}: {detail}); "
                                   f"the key came from {self.key_source}: check {KEY_ENV_VARS[0]} "
                                   f"(or {KEY_ENV_VARS[1]})") from None
                if status in _RETRY_STATUSES and attempt < self.max_retries:
                    delay = self._backoff(attempt, exc)
                    attempt += 1
                    self.retries += 1
                    log.warning("LLM endpoint %s answered HTTP %s (%s); retry %d of %d in %.2f s",
                                self.base_url, status, detail, attempt, self.max_retries, delay)
                    self._sleep(delay)
                    continue
                if status in _RETRY_STATUSES:
                    what = "rate limit" if status == 429 else "server error"
                    raise LLMError(f"the LLM endpoint at {self.base_url} kept answering HTTP {status} ({what}: {detail}) "
                                   f"after {self.max_retries} retries with backoff") from None
                if status == 404:
                    raise LLMError(f"the LLM endpoint at {self.base_url} answered HTTP 404 ({detail}): check the URL "
                                   f"(it usually ends in /v1) and the model name {self.model!r}") from None
                raise LLMError(f"the LLM endpoint at {self.base_url} answered HTTP {status}: {detail}") from None

    def _backoff(self, attempt: int, exc: Any) -> float:
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
        try:
            after = float(exc.response.headers.get("retry-after", ""))
            if 0 <= after <= self.backoff_max_s:
                delay = max(delay, after)
        except (AttributeError, TypeError, ValueError):
            pass
        return delay

    def _reply(self, resp: Any, messages: list[dict[str, Any]]) -> ChatReply:
        if not getattr(resp, "choices", None):
            raise LLMError(f"the LLM endpoint at {self.base_url} answered without choices: {self._clean(str(resp))[:300]}")
        choice = resp.choices[0]
        msg = choice.message
        out: dict[str, Any] = {"role": "assistant", "content": msg.content}
        calls = []
        for call in msg.tool_calls or []:
            fn = getattr(call, "function", None)
            args = getattr(fn, "arguments", "") or ""
            if not isinstance(args, str):  # some servers send an object; the conversation keeps JSON text
                args = json.dumps(args)
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": getattr(fn, "name", "") or "", "arguments": args}})
        if calls:
            out["tool_calls"] = calls
        usage = getattr(resp, "usage", None)
        total = getattr(usage, "total_tokens", None) if usage is not None else None
        if isinstance(total, int) and total > 0:
            tokens, reported = total, True
        else:
            tokens = estimate_tokens(json.dumps(messages, default=str)) + estimate_tokens(json.dumps(out, default=str))
            reported = False
        return ChatReply(message=out, tokens=tokens, usage_reported=reported, finish_reason=choice.finish_reason)

    def _clean(self, text: str) -> str:
        return str(scrub(text, secret_values(extra=self.secrets)))[:500]


def _error_text(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return str(getattr(exc, "message", "") or exc)


def estimate_tokens(text: str) -> int:
    """About four characters a token (the rule of thumb for English and code)."""
    return (len(text) + 3) // 4
