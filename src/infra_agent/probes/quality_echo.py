"""Asking a server for teacher-forced prompt logprobs: ``POST /v1/completions`` with ``echo``.

The quality probe's exchange with each of its two servers, apart from the probe because
it is the part that knows HTTP and the servers' ways of saying no: a server that does
not do echo + logprobs (HTTP 400, 422 or 501, or an answer without prompt logprobs)
raises ``NoLogprobs``, which the probe reports as a finding with no metrics; a prompt too
long for the context, or any other failure, is an ``InfraAgentError`` naming the server.
"""

from __future__ import annotations

from typing import Any

import httpx

from infra_agent.errors import InfraAgentError
from infra_agent.probes.quality_metrics import PromptLogprobs, Unusable, parse_echo

# Status codes that mean "this server does not do echo + logprobs" rather than "it broke".
_UNSUPPORTED_STATUS = frozenset({400, 422, 501})


class UrlTarget:
    """A plain URL seen through the ``RunningTarget`` surface."""

    def __init__(self, url: str, model: str | None) -> None:
        self.url, self.model, self.log_path, self.pid = url, model, None, None
        self.request_headers: dict[str, str] = {}

    def check_alive(self) -> None:
        return None


class Side:
    """One of the two servers: its role (baseline, candidate), its target, model and knobs."""

    def __init__(self, name: str, target: Any, model: str | None, knobs: dict[str, Any] | None) -> None:
        self.name, self.target, self.knobs = name, target, knobs
        self.model = model or getattr(target, "model", None)
        self.url = str(target.url).rstrip("/")
        self.headers = dict(getattr(target, "request_headers", None) or {})


class NoLogprobs(Exception):
    """A server that does not do echo + logprobs: no quality metric can be measured against it."""

    def __init__(self, side: Side, why: str, status: int | None = None) -> None:
        super().__init__(why)
        self.side, self.why, self.status = side, why, status


def prompt_logprobs(client: httpx.Client, side: Side, index: int, prompt: str, *, max_tokens: int,
                    logprobs: int) -> PromptLogprobs:
    """The server's teacher-forced logprobs of ``prompt`` (the ``index``-th of the set).

    Raises ``NoLogprobs`` when the server cannot give them, ``InfraAgentError`` for any
    other failure (a dead launched server raises its own, with its log)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": logprobs,
                            "temperature": 0}
    if side.model:
        body["model"] = side.model
    try:
        r = client.post(side.url + "/v1/completions", json=body, headers=side.headers)
    except httpx.HTTPError as exc:
        side.target.check_alive()  # a dead launched server says so with its log
        raise InfraAgentError(f"{side.name} server at {side.url}: {type(exc).__name__}: {exc}") from None
    if r.status_code == 400 and _too_long(r):
        raise InfraAgentError(f"prompt {index} is too long for the {side.name} server's context: {_error_text(r)} "
                              "(use shorter prompts: prompts_file)")
    if r.status_code in _UNSUPPORTED_STATUS:
        raise NoLogprobs(side, f"HTTP {r.status_code}: {_error_text(r)}", r.status_code)
    if r.status_code != 200:
        raise InfraAgentError(f"{side.name} server at {side.url}: HTTP {r.status_code}: {_error_text(r)}")
    try:
        return parse_echo(r.json())
    except ValueError as exc:  # Unusable, or a body that is not JSON
        if isinstance(exc, Unusable):
            raise NoLogprobs(side, str(exc)) from None
        raise InfraAgentError(f"{side.name} server at {side.url}: the answer is not JSON: {exc}") from None


def discover_model(client: httpx.Client, side: Side) -> str | None:
    """The first model the server lists, or None (then no ``model`` is sent)."""
    try:
        r = client.get(side.url + "/v1/models", headers=side.headers)
        data = r.json().get("data") if r.status_code == 200 else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None


def _error_text(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if isinstance(err, str):
            return err[:300]
    except (ValueError, AttributeError):
        pass
    return r.text[:300]


def _too_long(r: httpx.Response) -> bool:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and (err.get("code") == "context_length_exceeded"
                                      or "maximum context length" in str(err.get("message", "")))

