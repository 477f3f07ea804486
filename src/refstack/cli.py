"""``refstack``: serve the reference stack, list its knobs.

    refstack serve --preset tiny --port 0 [--knob value ...]
    refstack knobs [--json]

The ``serve`` options are built from ``refstack.knobs.KNOBS``, so the help, the
``knobs`` listing and the checks always agree.  Any usage error ends the process
with a one-line message and a non-zero status.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import socket
import sys
from typing import Any

try:
    import click
except ModuleNotFoundError:  # a base install of infra-agent: refstack and its CLI are an extra
    sys.stderr.write("refstack: error: refstack needs click, which is not installed: pip install 'infra-agent[refstack]'\n")
    raise SystemExit(2) from None

from refstack.knobs import KNOBS, Knob, KnobError, engine_config, parse_knobs


class _KnobType(click.ParamType):
    """Parses a flag through its knob, so domain errors read the same everywhere."""

    def __init__(self, knob: Knob) -> None:
        self.knob = knob
        self.name = knob.type

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self.knob.parse(value)
        except KnobError as exc:
            self.fail(str(exc), param, ctx)


def _option(knob: Knob) -> click.Option:
    help_text = f"{knob.help} [{knob.describe_domain()}; default {knob.default!r}; affects {', '.join(knob.components)}]"
    return click.Option([knob.flag, knob.name], type=_KnobType(knob), default=None, metavar=knob.type.upper(),
                        help=help_text)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """refstack: the reference hybrid-attention inference stack."""


def _serve(**raw: Any) -> None:
    values = parse_knobs({k: v for k, v in raw.items() if v is not None})
    # Imported here: torch and the model are heavy, and `refstack knobs` needs neither.
    import uvicorn

    from infra_agent import tracing
    from refstack.engine.device import PlacementError, resolve_placement
    from refstack.model.kv_dtypes import describe
    from refstack.server import create_app
    from refstack.server.app import cache_info

    try:  # before anything is built: a combination that cannot run is one line, not a traceback
        placement = resolve_placement(engine_config(values), disagg=values["disagg"] != "false")
    except PlacementError as exc:
        raise click.ClickException(str(exc)) from None
    try:  # INFRA_AGENT_TRACE_LEVEL is read when the tracer is first asked for: ask now
        tracing.get_tracer()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    from refstack.tp.checks import tp_problem

    problem = tp_problem(engine_config(values), disagg=values["disagg"] != "false")
    if problem:  # before a rank is spawned
        raise click.ClickException(problem)
    if values["cpu_kernels"] == "native":
        from refstack.kernels import cpu_kernels

        reason = cpu_kernels.unavailable_reason()
        if reason:
            raise click.ClickException(f"--cpu-kernels native: {reason}")
    sock = _bind(values["host"], values["port"])
    failures: list[str] = []

    def on_failure(reason: str) -> None:  # a disagg worker died: stop serving, exit non-zero
        failures.append(reason)
        os.kill(os.getpid(), signal.SIGTERM)

    app = create_app(engine_config(values), max_request_bytes=values["max_request_bytes"], disagg=_disagg_mode(values["disagg"]),
                     on_failure=on_failure)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    engine = app.state.engine
    # What the machine-dependent "auto" knobs became, after the URL (parsers take the URL up to a space).
    banner = (f"{url} (preset {values['preset']}, {_device_words(placement.device, values['kda_decode_kernel'])}"
              f"dtype {engine.dtype}, "
              f"{'native' if engine.native_kernels else 'torch'} kernels"
              f"{', ' + values['quantization'] if values['quantization'] != 'none' else ''}"
              f"{', disaggregated' if values['disagg'] != 'false' else ''}"
              f"{' with encode workers' if values['disagg'] == 'epd' else ''}"
              f"{_tp_words(engine.model) if values['tp'] > 1 or values['tp_gemm_precision'] != 'fp32' else ''})")
    # The cache's storage and what a sequence costs in it (also in GET /debug/engine "cache").
    print(f"refstack cache: {describe(cache_info(engine))}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=values["log_level"], timeout_graceful_shutdown=5))
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then re-raises the signal to the
    # handler it found.  A Python handler (not the default "die") lets the process end
    # normally afterwards, so atexit hooks run -- INFRA_AGENT_TRACE is written then.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _after_graceful_shutdown)
    asyncio.run(_serve_until_stopped(server, sock, banner))
    _exit_after_shutdown(1 if failures else 0, failures[0] if failures else "")


def _disagg_mode(value: str) -> bool | str:
    """create_app's ``disagg``: False, True (prefill + decode) or "epd"."""
    return value if value == "epd" else value == "true"


def _device_words(device: str, kda_decode_kernel: str) -> str:
    """The banner's device part: empty for the CPU defaults, so existing startup lines stay as they were."""
    words = [f"device {device}"] if device != "cpu" else []
    words += [f"{kda_decode_kernel} KDA decode"] if kda_decode_kernel != "torch" else []
    return "".join(w + ", " for w in words)


def _tp_words(model: Any) -> str:
    """The banner's tensor-parallel part: ranks, the collectives' backend, the projections' precision."""
    backend = f" ({model.backend})" if model.world > 1 else ""
    return f", tp {model.world}{backend}, tp-gemm {model.gemm_precision}"


def _exit_after_shutdown(status: int = 0, reason: str = "") -> None:
    """End the process without the interpreter's teardown, once uvicorn has shut down.

    With torch loaded, finalising modules and objects takes ~0.4 s, and none of it
    matters after a clean shutdown.  Every restart of a server in an A/B comparison
    pays it, so it is skipped.  The exit hooks still run (the trace file is written by
    one), and the streams are flushed; the engine thread has already been joined by
    the app's lifespan.
    """
    if reason:
        print(f"refstack: error: {reason}", file=sys.stderr)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _after_graceful_shutdown(signum: int, frame: Any) -> None:
    """Runs once uvicorn has already stopped cleanly; nothing is left to do."""


async def _serve_until_stopped(server: Any, sock: socket.socket, banner: str) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        # Flushed: the parent process (a test fixture, the agent) waits for this line.
        print(f"refstack serving on {banner}", flush=True)
    await task


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio turns
    # Nagle off (TCP_NODELAY) only on sockets whose proto says TCP.  With Nagle on, a
    # keep-alive connection held each streamed chunk behind the client's delayed ACK
    # of the previous segment: ~40 ms stalls, the whole stream in one burst.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise click.ClickException(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock


cli.add_command(click.Command(
    "serve", params=[_option(k) for k in KNOBS], callback=_serve,
    help="Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics, /debug/trace).",
))


@cli.command("knobs")
@click.option("--json", "as_json", is_flag=True, help="Print the knobs as JSON.")
def knobs_cmd(as_json: bool) -> None:
    """List every launch knob: name, type, domain (with its search space), default, components, help."""
    if as_json:
        click.echo(json.dumps([k.to_dict() for k in KNOBS], indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="refstack serve knobs")
    for col in ("flag", "type", "domain", "search", "default", "components", "help"):
        table.add_column(col, overflow="fold")
    for k in KNOBS:
        table.add_row(k.flag, k.type, k.describe_domain(), k.describe_search() or "-", repr(k.default),
                      ", ".join(k.components), k.help)
    # Wide when piped, so an agent reading the table gets whole rows.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def main(argv: list[str] | None = None) -> int:
    try:
        rv = cli.main(args=argv, prog_name="refstack", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("refstack: aborted", err=True)
        return 1
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.format_message(), err=True)  # bare `refstack`: the help, as click prints it
        return exc.exit_code
    except click.ClickException as exc:
        message = " ".join(exc.format_message().split())  # one line, whatever click composed
        click.echo(f"refstack: error: {message}", err=True)
        return exc.exit_code
    except ImportError as exc:
        # A base install of infra-agent (a URL benchmark) has no torch, fastapi or uvicorn.
        missing = (exc.name or "").split(".")[0]
        if missing not in ("torch", "fastapi", "uvicorn", "starlette"):
            raise
        click.echo(f"refstack: error: refstack needs {missing}, which is not installed: "
                   "pip install 'infra-agent[refstack]'", err=True)
        return 2
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
