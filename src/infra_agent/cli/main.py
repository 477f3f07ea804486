"""Entry point of ``infra-agent``.

Each verb lives in its own module ``infra_agent.cli.<verb>`` exposing
``register(app)``; this file only assembles them.
"""

from __future__ import annotations

import importlib

import typer

from infra_agent import __version__

app = typer.Typer(
    name="infra-agent",
    help="Find and fix performance bottlenecks in LLM inference stacks with dense, local feedback.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_VERB_MODULES = ("demo", "validate", "bench", "compare", "kernel")


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"infra-agent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version."),
) -> None:
    """infra-agent: an agent plus a dense feedback environment for LLM inference performance."""


for _verb in _VERB_MODULES:
    importlib.import_module(f"infra_agent.cli.{_verb}").register(app)


if __name__ == "__main__":
    app()
