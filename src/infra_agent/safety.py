"""What the agent may see and touch: secrets masked, paths confined, output bounded.

- ``scrub`` / ``scrub_text``: mask secrets in any text or JSON-like value before it is
  shown or written (console, ledger, report, prompt, tool result, log tail).  A secret is
  a *value*, and masking is by value: each occurrence of a known secret is replaced,
  wherever it appears.  The known secrets (``secret_values``, ``target_secrets``) are
  the values of environment variables whose names look secret (``secret_name``: HF_TOKEN,
  OPENAI_API_KEY, DB_PASSWORD), the same in a target's ``env``, the values after secret
  flags of a launch command (``--api-key VALUE``, ``--hf-token=VALUE``), secret header
  values, and the password of every ``scheme://user:pass@host`` URL among them.
  Some secrets are recognised by their form in any text: a URL's password
  (``postgres://user:***@host/db``), an ``Authorization`` header's or bearer token's
  value, and a credential-shaped value (letters and digits, no spaces, 8 or more
  characters) given to a secret name (``API_KEY=sk-...``, ``--hf-token hf_...``,
  ``"api_key": "sk-..."``).  A name alone never masks anything: ``per_token_ms``,
  ``token_ids``, ``key=lambda x: x`` and ``max_batch_tokens: 64`` come through intact.
- ``mask_values``: masking by value only (each known secret, and a URL's password), for
  what a tool returns to a model: source it reads, metric names, findings' evidence.  A
  form keyed on a name (``next_token = "tok_0123456789"``, ``password = args.password2``)
  is code there, not a secret; the secrets it could hold are the known ones.
- ``confine``: resolves a path (symlinks included) inside a root, or refuses it with
  the path named.
- ``bound``: cuts long text (a server log, kernel output) to head + tail with a count of
  what was dropped, so target output enters a prompt as bounded data.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
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
# A key, flag or assigned name holds a secret when its *last* word is one of those
# (``api_key``, ``--hf-token``; not ``api_key_env``, a variable's name, or ``token_ids``),
# and a value under it of any shape is a secret when that word says so unambiguously;
# after ``token`` or ``auth`` it must also look like a credential (``"token": " world"`` is text).
_PLAIN_SECRET_WORDS = frozenset({"apikey", "secret", "password", "passwd", "credential", "credentials",
                                 "authorization", "cookie"})
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
# Values this short are too likely to occur by chance (a "1" or "true") to be replaced.
_MIN_SECRET_LEN = 6
# What ends a value in free text: space, quotes, brackets, and a backslash, so that in
# JSON-encoded text (a log tail inside --json output: "A=1\\nB=2") an escaped newline ends
# the value instead of carrying the lines after it into one masked run.
_VALUE_END = "\\s'\",;(){}\\[\\]<>\\\\"
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s:/@?#]*:)([^\s/@?#]+)(@)")
_AUTH_HEADER = re.compile(r"(?i)\b((?:proxy-)?authorization['\"]?[ \t]*[:=][ \t]*['\"]?)(?:(bearer|basic|token|digest)[ \t]+)?"
                          rf"([^{_VALUE_END}]+)")
_BEARER = re.compile(r"(?i)\b(bearer[ \t]+)([A-Za-z0-9._~+/=-]{8,})")
# NAME=VALUE, NAME: VALUE, "NAME": "VALUE", --NAME=VALUE ...
_ASSIGNED = re.compile(rf"(?<![\w-])(['\"]?)(-{{0,2}}[A-Za-z_][\w.-]*)\1([ \t]*[:=][ \t]*)(['\"]?)([^{_VALUE_END}]+)")
# ... and --NAME VALUE.
_FLAG = re.compile(rf"(?<![\w-])(--[A-Za-z][\w-]*)([ \t]+['\"]?)([^{_VALUE_END}-][^{_VALUE_END}]*)")


def secret_name(name: str) -> bool:
    """Whether an environment variable's name looks secret: any of its words is a secret word."""
    return any(w.lower() in _SECRET_WORDS for w in _WORDS.findall(name))


def _words(name: str) -> list[str]:
    return [w.lower() for w in _WORDS.findall(name)]


def holds_secret(name: str) -> bool:
    """Whether a mapping key, a flag or an assigned name holds a secret: its last word is a
    secret word (``api_key``, ``HF_TOKEN``, ``--hf-token``), but not a bare ``key`` (a sort key)."""
    words = _words(name)
    return bool(words) and words[-1] in _SECRET_WORDS and words != ["key"]


def _plainly_secret(name: str) -> bool:
    words = _words(name)
    return bool(words) and (words[-1] in _PLAIN_SECRET_WORDS or words[-2:] == ["api", "key"])


def _credential_like(value: str) -> bool:
    """A long unbroken run of letters and digits (``sk-...``, ``hf_...``, a hex token); not a word,
    a number or code (``lambda``, ``tokenizer.encode``, ``Optional``)."""
    return (len(value) >= 8 and not any(c.isspace() for c in value)
            and any(c.isdigit() for c in value) and any(c.isalpha() for c in value))


def _maskable(value: object) -> bool:
    """Worth replacing wherever it occurs: long enough not to occur by chance, and not a number."""
    return isinstance(value, str) and len(value) >= _MIN_SECRET_LEN and value != MASK and not _NUMBER.fullmatch(value)


def url_passwords(text: str) -> list[str]:
    """The passwords of the ``scheme://user:pass@host`` URLs in ``text``."""
    return [m.group(2) for m in _URL_PASSWORD.finditer(text)]


def env_secrets(env: Mapping[str, str]) -> list[str]:
    """The values of the secret-named variables of ``env``, and the URL passwords in any of its values."""
    out = [v for k, v in env.items() if secret_name(k)]
    out += [p for v in env.values() if isinstance(v, str) for p in url_passwords(v)]
    return [v for v in out if _maskable(v)]


def command_secrets(command: str | Sequence[str]) -> list[str]:
    """The values after secret flags (``--api-key VALUE``, ``--hf-token=VALUE``) of a command,
    and the URL passwords in it.  A word holding spaces (``sh -c "..."``) is split as a shell would."""
    words = _command_words([command] if isinstance(command, str) else list(command))
    out: list[str] = []
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if word.startswith("-") and holds_secret(name):
            if eq:
                out.append(value)
            elif i + 1 < len(words) and not words[i + 1].startswith("-"):
                out.append(words[i + 1])
        out += url_passwords(word)
    # A template's placeholder ({api_key}) or a shell's variable ($API_KEY) is not the value.
    return [v for v in out if _maskable(v) and "{" not in v and not v.startswith("$")]


def _command_words(parts: list[str], depth: int = 3) -> list[str]:
    """Words of a command; a word holding spaces (the script of ``sh -c "..."``) is split again."""
    words: list[str] = []
    for part in parts:
        if depth and any(c.isspace() for c in part):
            try:
                split = shlex.split(part)
            except ValueError:  # unbalanced quotes
                split = part.split()
            words += _command_words(split, depth - 1)
        else:
            words.append(part)
    return words


def header_secrets(headers: Mapping[str, str]) -> list[str]:
    """The values of secret headers (``Authorization``, ``X-Api-Key``, ``Cookie``), with and without their scheme."""
    out: list[str] = []
    for name, value in headers.items():
        if secret_name(name):
            out.append(value)
            _, _, token = value.partition(" ")
            out.append(token.strip())
    return [v for v in out if _maskable(v)]


def target_secrets(target: object) -> list[str]:
    """The secret values a workspace's target holds: its ``env`` (``env_secrets``), its launch
    command (``command_secrets``), its ``headers``, the key its ``api_key_env`` names, and a URL's password."""
    if target is None:
        return []
    out = env_secrets(getattr(target, "env", None) or {})
    command = getattr(target, "command", None)
    if command:
        out += command_secrets(command)
    out += header_secrets(getattr(target, "headers", None) or {})
    key_env = getattr(target, "api_key_env", None)
    if key_env and os.environ.get(key_env):
        out.append(os.environ[key_env])
    for url in (getattr(target, "url", None), getattr(target, "metrics_url", None)):
        if isinstance(url, str):
            out += url_passwords(url)
    return [v for v in out if _maskable(v)]


def secret_values(environ: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """The values to mask: those of the environment (``env_secrets``; default ``os.environ``) plus ``extra``."""
    env = os.environ if environ is None else environ
    vals = set(env_secrets(env)) | {v for v in extra if _maskable(v)}
    # Longest first, so a secret that contains another is replaced whole.
    return sorted(vals, key=len, reverse=True)


def workspace_secrets(workspace: object) -> list[str]:
    """``secret_values`` plus the secrets of a workspace's target (None: the environment's only)."""
    return secret_values(extra=target_secrets(getattr(workspace, "target", None)))


def _url_password(m: re.Match[str]) -> str:
    return f"{m.group(1)}{MASK}{m.group(3)}"


def _header(m: re.Match[str]) -> str:
    # After a scheme the value is the credential; without one, only what looks like one (not ``authorization: str``).
    if m.group(2) is None and not _credential_like(m.group(3)):
        return m.group(0)
    return f"{m.group(1)}{m.group(2) + ' ' if m.group(2) else ''}{MASK}"


def _bearer(m: re.Match[str]) -> str:
    token = m.group(2)
    return m.group(0) if token.isalpha() and token.islower() else f"{m.group(1)}{MASK}"  # "bearer authentication"


def _assigned(m: re.Match[str]) -> str:
    if not holds_secret(m.group(2)):
        # The value may hold an assignment of its own ('"log_tail": "HF_TOKEN=hf_..."'):
        # a match consumes its text, so look inside the value (shorter than the match: this ends).
        value = m.group(5)
        inner = _ASSIGNED.sub(_assigned, value)
        return m.group(0) if inner == value else m.group(0)[: m.start(5) - m.start(0)] + inner
    if not _credential_like(m.group(5)):
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{MASK}"


def _flag(m: re.Match[str]) -> str:
    if not holds_secret(m.group(1)) or not _credential_like(m.group(3)):
        return m.group(0)
    return f"{m.group(1)}{m.group(2)}{MASK}"


# The secrets known by their form, whatever the text: each pattern with what it leaves of a match.
_FORMS: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (_URL_PASSWORD, _url_password), (_AUTH_HEADER, _header), (_BEARER, _bearer), (_ASSIGNED, _assigned), (_FLAG, _flag))


def scrub_text(text: str, values: Iterable[str] | None = None) -> str:
    """``text`` with each of ``values`` (default: the environment's secrets) and each secret
    known by its form (a URL's password, a header's or a secret name's credential) masked."""
    for v in secret_values() if values is None else values:
        if v in text:
            text = text.replace(v, MASK)
    for pattern, mask in _FORMS:
        text = pattern.sub(mask, text)
    return text


def _secret_entry(key: object, value: object) -> bool:
    """Whether ``value``, under ``key`` in a mapping, is a secret however it reads: text (never a
    number) under a key that holds one, of secret length, shaped like a credential unless the key is
    plainly a secret (``password``, ``api_key``)."""
    if not isinstance(key, str) or not isinstance(value, str) or not _maskable(value) or not holds_secret(key):
        return False
    return _plainly_secret(key) or _credential_like(value)


def scrub(value: Any, values: Iterable[str] | None = None) -> Any:
    """A copy of ``value`` (str, dict, list, pydantic-dumped data) with secrets masked.

    Text goes through ``scrub_text``, mapping keys included; a value under a key that holds a
    secret (``_secret_entry``) becomes ``***``; numbers and booleans are never touched."""
    vals = secret_values() if values is None else list(values)
    return _scrub(value, vals)


def _scrub(value: Any, vals: list[str]) -> Any:
    if isinstance(value, str):
        return scrub_text(value, vals)
    if isinstance(value, Mapping):
        return {(scrub_text(k, vals) if isinstance(k, str) else k): MASK if _secret_entry(k, v) else _scrub(v, vals)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        # An argv (["vllm", "serve", "--api-key", "sk-..."]): its flags' values are secrets too.
        if any(isinstance(v, str) and v.startswith("-") for v in value):
            found = command_secrets([v for v in value if isinstance(v, str)])
            vals = sorted({*vals, *found}, key=len, reverse=True) if found else vals
        items = [_scrub(v, vals) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _template_password(m: re.Match[str]) -> str:
    # A template's placeholder (``{password}``, ``$DB_PASS``) is not the value.
    pw = m.group(2)
    return m.group(0) if "{" in pw or pw.startswith("$") else _url_password(m)


def mask_values(value: Any, values: Iterable[str] | None = None) -> Any:
    """``value`` (text, or JSON-like data with its keys) with each of ``values`` (default: the
    environment's secrets) and each URL's password masked, and nothing else: no name, word or
    shape of text masks anything, so code and metric names come through as written.  Numbers and
    booleans are never touched."""
    vals = secret_values() if values is None else sorted({v for v in values if _maskable(v)}, key=len, reverse=True)
    return _mask_values(value, vals)


def _mask_values(value: Any, vals: list[str]) -> Any:
    if isinstance(value, str):
        for v in vals:
            if v in value:
                value = value.replace(v, MASK)
        return _URL_PASSWORD.sub(_template_password, value)
    if isinstance(value, Mapping):
        return {_mask_values(k, vals): _mask_values(v, vals) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_mask_values(v, vals) for v in value]
        return items if isinstance(value, list) else tuple(items)
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
