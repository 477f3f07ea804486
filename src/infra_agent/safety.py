"""What the agent may see and touch: secrets scrubbed, paths confined, output bounded.

- ``scrub``: removes secrets from any text or JSON-like value before it reaches the
  ledger, a log, a prompt or a report.  A secret is the value of an environment
  variable whose name looks secret (``*KEY*``, ``*TOKEN*``, ``*SECRET*``,
  ``*PASSWORD*``, ``*CREDENTIAL*``), an ``Authorization`` header, a bearer token, or
  a value under such a key in a mapping.
- ``confine``: resolves a path (symlinks included) inside a root, or refuses it with
  the path named.
- ``bound``: cuts long text (a server log, kernel output) to head + tail with a count of
  what was dropped, so target output enters a prompt as bounded data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from infra_agent.errors import InfraAgentError

MASK = "***"
# A name is secret when one of its words (split at _, -, . and camelCase) is one of
# these: HF_TOKEN, OPENAI_API_KEY, apiKey, db_password.  Plurals and counts are not
# secrets: max_batch_tokens, llm_tokens, num_keys.
# ("pwd" is not one of them: $PWD is the working directory.)
_SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential",
                           "credentials", "authorization", "auth", "bearer", "cookie"})
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_AUTH_HEADER = re.compile(r"(?i)(authorization\s*[:=]\s*)(\"?)(bearer\s+|basic\s+)?([^\s\"',}]+)")
_BEARER = re.compile(r"(?i)\b(bearer\s+)([A-Za-z0-9._~+/=-]{8,})")
_KV = re.compile(r"\b([A-Za-z][A-Za-z0-9_]*)(\s*[=:]\s*)(\"?)([^\s\"',}]+)")
# Values this short are too likely to occur by chance (a "1" or "true") to be replaced.
_MIN_SECRET_LEN = 6


def secret_name(name: str) -> bool:
    """Whether an environment variable or mapping key names a secret."""
    return any(w.lower() in _SECRET_WORDS for w in _WORDS.findall(name))


def secret_values(environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """The values to remove: secret-looking environment variables plus ``extra``."""
    env = os.environ if environ is None else environ
    vals = {v for k, v in env.items() if secret_name(k) and len(v) >= _MIN_SECRET_LEN}
    vals |= {v for v in extra if v and len(v) >= _MIN_SECRET_LEN}
    # Longest first, so a secret that contains another is replaced whole.
    return sorted(vals, key=len, reverse=True)


def scrub_text(text: str, values: Iterable[str] | None = None) -> str:
    for v in secret_values() if values is None else values:
        if v in text:
            text = text.replace(v, MASK)
    text = _AUTH_HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) or ''}{MASK}", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}{MASK}", text)
    def kv(m: re.Match[str]) -> str:
        if not secret_name(m.group(1)) or m.group(4) == MASK or m.group(4).lower() in ("bearer", "basic"):
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{m.group(3)}{MASK}"

    return _KV.sub(kv, text)


def scrub(value: Any, values: Iterable[str] | None = None) -> Any:
    """A copy of ``value`` (str, dict, list, pydantic-dumped data) with secrets masked."""
    vals = secret_values() if values is None else list(values)
    if isinstance(value, str):
        return scrub_text(value, vals)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            # Secrets are text; a number under a key like "auth_retries" is not one.
            if isinstance(k, str) and secret_name(k) and isinstance(v, str) and v:
                out[k] = MASK
            else:
                out[k] = scrub(v, vals)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(scrub(v, vals) for v in value)
    return value


def replace_values(value: Any, secrets: Iterable[str], mark: str = MASK) -> Any:
    """``value`` (JSON-like) with every occurrence of each of ``secrets`` replaced by ``mark``.

    Only the given values, none of ``scrub``'s patterns: for callers that know exactly
    which values are secret (a key read from a named variable)."""
    found = [s for s in secrets if s]
    if not found:
        return value
    if isinstance(value, str):
        for s in found:
            value = value.replace(s, mark)
        return value
    if isinstance(value, dict):
        return {k: replace_values(v, found, mark) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_values(v, found, mark) for v in value]
    return value


class PathEscape(InfraAgentError):
    """A path that resolves outside the tree the agent was given."""


def confine(root: str | Path, path: str | Path) -> Path:
    """``path`` (relative to ``root``) resolved with symlinks; refused if it leaves ``root``."""
    base = Path(root).resolve()
    raw = Path(path)
    if raw.is_absolute():
        raise PathEscape(f"path {str(path)!r} is absolute; give a path relative to the worktree {base}")
    full = (base / raw).resolve()
    if full != base and base not in full.parents:
        raise PathEscape(f"path {str(path)!r} resolves to {full}, outside the worktree {base}")
    return full


def bound(text: str, limit: int = 8000, head_share: float = 0.3) -> str:
    """At most ``limit`` characters: head and tail with how much was dropped between."""
    if len(text) <= limit:
        return text
    head = int(limit * head_share)
    tail = limit - head
    dropped = len(text) - head - tail
    lines = text.count("\n", head, len(text) - tail)
    return f"{text[:head]}\n[... {dropped} characters ({lines} lines) cut ...]\n{text[len(text) - tail:]}"


def read_bounded(path: str | Path, limit: int = 8000) -> str:
    """The head and tail of a file of any size, read without loading it whole."""
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as f:
        if size <= limit:
            return f.read().decode("utf-8", errors="replace")
        head = int(limit * 0.3)
        first = f.read(head)
        f.seek(size - (limit - head))
        last = f.read()
    dropped = size - len(first) - len(last)
    return (first.decode("utf-8", errors="replace") + f"\n[... {dropped} bytes cut ...]\n"
            + last.decode("utf-8", errors="replace"))
