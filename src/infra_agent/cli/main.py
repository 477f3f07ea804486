"""Entry point of ``infra-agent``.

Each verb lives in its own module ``infra_agent.cli.<verb>`` exposing
``register(app)``, which adds the command ``<verb>`` to ``app``.  This file only
assembles them, and lazily: ``_VERB_MODULES`` maps each verb to its one-line help,
which is all ``infra-agent --help`` shows, so listing the verbs imports no verb
module.  A verb's module is imported when that verb runs (``infra-agent compare
...``) or shows its own help (``infra-agent compare --help``).

Start-up rules (``tests/infra_agent/test_cli_startup.py`` checks them):

- Adding a verb: write ``infra_agent/cli/<verb>.py`` with ``register(app)`` that adds
  exactly the command ``<verb>``, and add ``"<verb>": "<its one-line help>"`` to
  ``_VERB_MODULES`` (the same text as the first line of the command's docstring or
  ``help=``; the test compares them).
- A verb module's top level stays light: the standard library, ``typer``, ``rich``,
  ``infra_agent.errors`` and ``infra_agent.cli.output``.  Everything heavier (numpy,
  scipy, torch, aiohttp, httpx, pydantic models, the bench runner, the judge, the
  kernel lab, the demo) is imported inside the command function, so ``infra-agent
  VERB --help`` is as quick as ``infra-agent --help`` and a typo costs no scipy import.
  Type hints that need a heavy class go under ``if TYPE_CHECKING:`` (every module
  here has ``from __future__ import annotations``).
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from infra_agent import __version__
from infra_agent.extras import missing_modules

# verb -> one-line help, in the order ``--help`` lists them.
_VERB_MODULES: dict[str, str] = {
    "demo": "Build a demo workspace from refstack and run the feedback loop's steps on it.",
    "run": "Run the agent loop on a workspace until its gates pass or the budget ends.",
    "resume": "Continue a run that was killed or interrupted; finished experiments are kept, none is repeated.",
    "ls": "List the runs in a workspace's ledger.",
    "report": "Write the run's report: one self-contained HTML file and a Markdown summary.",
    "mcp": "Serve the agent's tools and the environment's verbs to MCP clients (stdio or HTTP).",
    "standin": "Serve a scripted, deterministic stand-in for an OpenAI-compatible chat model (not a model).",
    "trace": "Timeline analysis: overlap, GIL attribution, critical path, trends and diffs of traces.",
    "validate": "Check infra-agent.yaml: target, knobs, scenarios, criteria. Exit 2 on any problem.",
    "bench": "Run one serving benchmark and print vLLM-style metrics (+ server phases).",
    "compare": "Per-metric ratio B/A with a confidence interval, and a verdict per criterion.",
    "goodput": "Search the highest request rate meeting the SLO, per configuration, and print the sweep table.",
    "calibrate": "Measure the spread between fresh server processes of one configuration; the loop's interval uses it.",
    "kernel": "Kernel lab: correctness across variants and precisions, microbenchmarks, roofline.",
}


# verb -> (the modules it cannot run without, the extra that installs them).  A base
# install (``pip install infra-agent``: benchmarking a URL, comparing, validating, the
# loop on a URL target) has none of them; the verb then says in one line which extra
# to install, and exits 2.  ``run --executor ray`` checks for Ray itself.
_EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "demo": (("torch", "fastapi", "uvicorn"), "refstack"),
    "kernel": (("torch",), "kernels"),
    "mcp": (("mcp",), "mcp"),
    "standin": (("fastapi", "uvicorn"), "standin"),
}


def _guard_extra(verb: str, cmd: Any) -> Any:
    """Wrap ``cmd`` so that running it without its extra prints the install line and exits 2
    (its ``--help`` still works: click answers it before ``invoke``)."""
    if verb not in _EXTRAS:
        return cmd
    modules, extra = _EXTRAS[verb]
    invoke = cmd.invoke

    def guarded(ctx: Any) -> Any:
        missing = missing_modules(modules)
        if missing and "--help" not in (getattr(ctx, "protected_args", None) or []) + list(ctx.args):
            from infra_agent.cli.output import user_errors
            from infra_agent.errors import InfraAgentError

            as_json = bool(ctx.params.get("as_json")) or "--json" in ctx.args
            with user_errors(as_json):
                raise InfraAgentError(f"infra-agent {verb} needs {', '.join(missing)}, which "
                                      f"{'is' if len(missing) == 1 else 'are'} not installed: "
                                      f"pip install 'infra-agent[{extra}]'")
        return invoke(ctx)

    cmd.invoke = guarded
    return cmd


class _Unloaded(TyperCommand):
    """Stands for a verb whose module is not imported yet: a name and a help line."""


def load_verb(verb: str) -> Any:
    """The command ``verb`` as its module registers it (imports the module)."""
    sub = typer.Typer()
    importlib.import_module(f"infra_agent.cli.{verb}").register(sub)
    commands = typer.main.get_group(sub).commands
    if verb not in commands:
        raise RuntimeError(f"infra_agent.cli.{verb}.register() must add a command named {verb!r}, added {sorted(commands)}")
    return commands[verb]


class _LazyVerbs(TyperGroup):
    """A group whose verbs are imported on first use, not when the group is built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._listing = False
        for verb, help_line in _VERB_MODULES.items():
            # placeholders keep the order and make "No such command" suggestions work
            self.commands.setdefault(verb, _Unloaded(name=verb, help=help_line))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if isinstance(cmd, _Unloaded) and not self._listing:
            cmd = self.commands[cmd_name] = _guard_extra(cmd_name, load_verb(cmd_name))
        return cmd

    def format_help(self, ctx: Any, formatter: Any) -> None:
        # Listing the verbs needs only their help lines: leave the modules unimported.
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="infra-agent",
    help="Find and fix performance bottlenecks in LLM inference stacks with dense, local feedback.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_LazyVerbs,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"infra-agent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True, help="Print the version."),
) -> None:
    """infra-agent: an agent plus a dense feedback environment for LLM inference performance."""


if __name__ == "__main__":
    app()
