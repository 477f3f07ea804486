"""Shared CLI plumbing: one way to print results (rich text or JSON) and errors.

Everything printed goes through :mod:`infra_agent.safety`'s masking: ``emit``'s JSON is
scrubbed as data, and both consoles mask what they render and what they write, so a
server's log tail, a model's text or an error message never shows a secret of the
environment on the terminal.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, cast

import typer
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from infra_agent.errors import InfraAgentError
from infra_agent.safety import scrub, scrub_text


def _width(stream: object) -> int | None:
    """Rich assumes 80 columns when output is piped; our tables are wider than that,
    and a log file has no width limit, so piped output gets a generous width."""
    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return 160


class _MaskedStream(io.TextIOBase):
    """The stream ``stream()`` returns (looked up on each write, so a redirected
    ``sys.stdout`` is followed), with secrets masked in everything written to it."""

    def __init__(self, stream: Callable[[], IO[str]]) -> None:
        self._stream = stream

    def _target(self) -> IO[str]:
        # Inside a rich Live, sys.stdout/stderr are proxies that print through the console
        # again; write to what they proxy.
        stream = self._stream()
        return getattr(stream, "rich_proxied_file", stream)

    def write(self, text: str) -> int:
        self._target().write(scrub_text(text))
        return len(text)

    def flush(self) -> None:
        self._target().flush()

    def close(self) -> None:
        """Nothing: the wrapped stream is not ours to close (nor to flush at interpreter exit)."""

    def isatty(self) -> bool:
        return self._target().isatty()

    def fileno(self) -> int:
        return self._target().fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target(), "encoding", None) or "utf-8"


class MaskedConsole(Console):
    """A rich ``Console`` that masks secrets in text before rendering it (a secret wrapped over
    two lines would escape the stream's masking) and in what it writes."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(scrub_text(text), **kwargs)


def masked_console(stream: Callable[[], IO[str]], width: int | None = None) -> MaskedConsole:
    """A console on the stream ``stream()`` returns, masking secrets in what it renders and writes."""
    return MaskedConsole(file=cast("IO[str]", _MaskedStream(stream)), width=width)


# stderr for progress and errors so that `--json` output on stdout stays parseable.
console = masked_console(lambda: sys.stdout, width=_width(sys.stdout))
err_console = masked_console(lambda: sys.stderr, width=_width(sys.stderr))


def emit(result: Any, as_json: bool, render: Callable[[Console], None]) -> None:
    """Print ``result`` as JSON when ``--json`` was given, else call ``render``."""
    if as_json:
        if hasattr(result, "model_dump"):
            result = result.model_dump(mode="json")
        # scrub the data (a value under a secret key), then the text (what default=str made of other objects)
        sys.stdout.write(scrub_text(json.dumps(scrub(result), indent=2, default=str)) + "\n")
    else:
        render(console)


@contextmanager
def user_errors(as_json: bool = False) -> Iterator[None]:
    """Turn project errors into a clean message and exit status 2 (no traceback)."""
    try:
        yield
    except InfraAgentError as exc:
        message = scrub_text(str(exc))
        if as_json:
            sys.stdout.write(json.dumps({"error": type(exc).__name__, "message": message}, indent=2) + "\n")
        # soft_wrap: a message is never broken inside a path or a command, so it can be copied.
        # escape: a message may hold brackets (``pip install 'infra-agent[ray]'``) that are not markup.
        err_console.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
