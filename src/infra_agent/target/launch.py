"""Render a server target's launch template into an argv, env, cwd and URLs.

Shell or not:
- a list ``command`` is an argv; each element is rendered, nothing is quoted, no shell;
- a string ``command`` is split like a POSIX shell would (``shlex``) and each word is
  rendered, so a knob value with spaces stays one argument, still without a shell;
- only when the string uses shell syntax (``|``, ``&&``, ``;``, redirects, ``$VAR``,
  backticks, globs, ``~``) does it run as ``/bin/sh -c``; then every substituted value
  is ``shlex.quote``d, so a value is always one word and never code.  Write such
  placeholders bare (``--name {x}``), not inside quotes.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infra_agent.errors import ConfigError
from infra_agent.target import vllm_build
from infra_agent.workspace import template
from infra_agent.workspace.knobs import MISSING, KnobValue, render_value
from infra_agent.workspace.models import ServerTargetSpec

_SHELL_OPERATORS = set("|&;<>()")
_SHELL_CHARS = ("$", "`", "*", "?", "[")


@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]  # the full environment of the child
    cwd: Path
    ready_url: str
    metrics_url: str | None
    uses_shell: bool
    # What the launch changed so the installed engine runs (target/vllm_build.py), or None.
    adapted: str | None = None


def needs_shell(command: str) -> bool:
    """Whether a string template uses syntax only a shell understands."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return True  # unbalanced quotes: let the shell report it in the log
    if any(w and set(w) <= _SHELL_OPERATORS for w in words):
        return True
    return any(c in command for c in _SHELL_CHARS) or any(w.startswith("~") for w in words)


def _url(template_text: str, values: Mapping[str, str], host: str, port: int) -> str:
    rendered = template.render(template_text, values)
    if rendered.startswith("/"):
        return f"http://{host}:{port}{rendered}"
    return rendered


def plan_launch(
    spec: ServerTargetSpec,
    knobs: Mapping[str, KnobValue],
    port: int,
    *,
    root: Path,
    host: str,
    file: str | None = None,
) -> LaunchPlan:
    """Fill the placeholders of ``spec`` with ``port`` and the knob values."""
    values = {name: render_value(value) for name, value in knobs.items()}
    values["port"] = str(port)
    for name in sorted({name for _, name in spec.missing_values(values)}):
        raise ConfigError(file, f"knobs.{name}", f"a value for {{{name}}} (no default declared; pass --set {name}=...)", MISSING)

    uses_shell = False
    if isinstance(spec.command, list):
        argv = [template.render(part, values) for part in spec.command]
    elif needs_shell(spec.command):
        uses_shell = True
        quoted = {name: shlex.quote(v) for name, v in values.items()}
        argv = ["/bin/sh", "-c", template.render(spec.command, quoted)]
    else:
        argv = [template.render(word, values) for word in shlex.split(spec.command)]

    env = dict(os.environ)
    # Python servers otherwise block-buffer stdout into the log file, and the log
    # tail shown on a crash would miss the last lines.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update({k: template.render(v, values) for k, v in spec.env.items()})
    cwd = root if spec.cwd is None else (root / template.render(spec.cwd, values))
    # `vllm serve` runs through the module entrypoint where the script cannot (the CPU build).
    argv, env, adapted = (argv, env, None) if uses_shell else vllm_build.resolve_launch(argv, env)
    metrics = _url(spec.metrics_url, values, host, port) if spec.metrics_url is not None else None
    return LaunchPlan(argv, env, cwd, _url(spec.ready_url, values, host, port), metrics, uses_shell, adapted)
