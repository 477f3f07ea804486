"""Shared CLI plumbing: one way to print results (rich text or JSON) and errors."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from infra_agent.errors import InfraAgentError


def _width(stream: object) -> int | None:
    """Rich assumes 80 columns when output is piped; our tables are wider than that,
    and a log file has no width limit, so piped output gets a generous width."""
    if os.environ.get("COLUMNS") or (hasattr(stream, "isatty") and stream.isatty()):
        return None
    return 160


# stderr for progress and errors so that `--json` output on stdout stays parseable.
console = Console(width=_width(sys.stdout))
err_console = Console(stderr=True, width=_width(sys.stderr))


def emit(result: Any, as_json: bool, render: Callable[[Console], None]) -> None:
    """Print ``result`` as JSON when ``--json`` was given, else call ``render``."""
    if as_json:
        if hasattr(result, "model_dump"):
            result = result.model_dump(mode="json")
        sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
    else:
        render(console)


@contextmanager
def user_errors(as_json: bool = False) -> Iterator[None]:
    """Turn project errors into a clean message and exit status 2 (no traceback)."""
    try:
        yield
    except InfraAgentError as exc:
        if as_json:
            sys.stdout.write(json.dumps({"error": type(exc).__name__, "message": str(exc)}, indent=2) + "\n")
        # soft_wrap: a message is never broken inside a path or a command, so it can be copied.
        # escape: a message may hold brackets (``pip install 'infra-agent[ray]'``) that are not markup.
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None
