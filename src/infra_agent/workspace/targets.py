"""Target specs: what ``target:`` in ``infra-agent.yaml`` names as the server under test.

A ``server`` target is launched by infra-agent itself from a templated command; an
``endpoint`` target is an OpenAI-compatible server that is already running.  Both
share :class:`_Auth`, the credentials sent with every request.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from infra_agent.workspace import template
from infra_agent.workspace._base import _Strict
from infra_agent.workspace.knobs import DomainError


class _Auth(_Strict):
    """Credentials for the target's HTTP API, shared by both target kinds."""

    # The NAME of an environment variable holding the server's API key (e.g. for
    # vLLM's --api-key); sent as ``Authorization: Bearer``, never stored.
    api_key_env: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)  # extra headers on every request

    @field_validator("api_key_env")
    @classmethod
    def _env_var_name(cls, name: str | None) -> str | None:
        if name is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise DomainError((), "the NAME of an environment variable holding the key (letters, digits, _), not the key", "a value that is not a name")
        return name

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: dict[str, str]) -> dict[str, str]:
        for name in headers:
            if not re.match(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$", name):
                raise DomainError((name,), "an HTTP header name", name)
            if name.lower() == "authorization":
                raise DomainError((name,), "no Authorization header in the file (name the key's variable in api_key_env)", name)
        return headers


class ServerTargetSpec(_Auth):
    """A server infra-agent launches itself, on a free loopback port."""

    kind: Literal["server"]
    # A list is an argv (no shell).  A string is split like a shell would, and runs
    # under /bin/sh only when it uses shell syntax (pipes, &&, $VAR ...).
    command: str | Annotated[list[str], Field(min_length=1)]
    # A path on the launched server (``/health``) or a full URL template.
    ready_url: str = "/health"
    metrics_url: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None  # relative to the workspace root
    ready_timeout_s: float = Field(300.0, gt=0)
    stop_grace_s: float = Field(10.0, gt=0)
    model: str | None = None  # the model name sent in requests

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars_as_text(cls, env: Any) -> Any:
        # YAML reads `OMP_NUM_THREADS: 4` as an int; the environment only holds text.
        if isinstance(env, dict):
            return {k: ("true" if v is True else "false" if v is False else str(v)) if isinstance(v, (int, float)) else v for k, v in env.items()}
        return env

    def templates(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Every templated string with its sub-path, for placeholder checks."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        if isinstance(self.command, str):
            out.append((("command",), self.command))
        else:
            out.extend((("command", i), part) for i, part in enumerate(self.command))
        out.append((("ready_url",), self.ready_url))
        if self.metrics_url is not None:
            out.append((("metrics_url",), self.metrics_url))
        out.extend((("env", k), v) for k, v in self.env.items())
        if self.cwd is not None:
            out.append((("cwd",), self.cwd))
        return out

    def missing_values(self, have: Collection[str]) -> list[tuple[tuple[str | int, ...], str]]:
        """Placeholders that ``have`` gives no value for, each with the field it sits in."""
        return [(sub, name) for sub, text in self.templates() for name in template.placeholders(text) if name not in have]


class EndpointTargetSpec(_Auth):
    """An already-running OpenAI-compatible server; requests go to ``{url}/v1/...``."""

    kind: Literal["endpoint"]
    url: str  # base URL, e.g. http://10.0.0.5:8000 (no /v1)
    ready_url: str | None = None  # if set, must answer 200 before a run
    metrics_url: str | None = None  # a path on ``url`` or a full URL
    model: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise DomainError((), "an http:// or https:// base URL", url)
        return url.rstrip("/")


# A `python` kind (kernels) joins this union later.
Target = Annotated[ServerTargetSpec | EndpointTargetSpec, Field(discriminator="kind")]
