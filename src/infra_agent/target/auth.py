"""Request headers for a target: extra headers and a bearer key read from the environment.

A workspace names the *variable* that holds the key (``api_key_env``), never the key, so
neither ``infra-agent.yaml`` nor a result file ever holds it.  The key is read when a
run starts and sent as ``Authorization: Bearer <key>`` (vLLM's ``--api-key``, hosted
endpoints).  Results record the variable's name and the header names, not values.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from infra_agent.errors import ConfigError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# RFC 9110 token characters.
HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
REDACTED = "<redacted>"


def request_headers(api_key_env: str | None, headers: Mapping[str, str] | None = None, *, file: str | None = None,
                    field: str = "target.api_key_env") -> dict[str, str]:
    """``headers`` plus ``Authorization: Bearer $api_key_env``; ConfigError when the variable is unset."""
    out = dict(headers or {})
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ConfigError(file, field, f"the environment variable {api_key_env} to hold the API key", "unset or empty")
        out["Authorization"] = f"Bearer {key}"
    return out


def parse_header(text: str, *, field: str = "--header") -> tuple[str, str]:
    """``'Name: value'`` -> (name, value)."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not HEADER_NAME.match(name):
        # Never echo the value: it may be a credential.
        raise ConfigError(None, field, "'Name: value' with a header name of letters, digits and -",
                          f"{name}: ..." if sep else "text without ':'")
    return name, value


def secrets_of(headers: Mapping[str, str]) -> list[str]:
    """Header values that must never be printed or written: all of them but short flags."""
    out: list[str] = []
    for name, value in headers.items():
        if name.lower() == "authorization":
            out.append(value)
            _, _, token = value.partition(" ")
            if token:
                out.append(token)
        elif len(value) >= 8:
            out.append(value)
    return sorted(set(out), key=len, reverse=True)


def redact(obj: Any, secrets: Iterable[str]) -> Any:
    """``obj`` (JSON-like) with every occurrence of each secret replaced."""
    from infra_agent.safety import replace_values

    return replace_values(obj, secrets, REDACTED)
