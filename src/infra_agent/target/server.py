"""``ServerProcess``: launch a server target, wait until it is ready, always stop it.

The server runs as the leader of a new session (``start_new_session=True``), so its
process group holds everything it spawns and a terminal's Ctrl-C reaches only us.
Stopping sends SIGTERM to the group, then SIGKILL after a grace period.  It runs on
every way out of the ``with`` block: normal exit, exceptions, Ctrl-C, and SIGTERM or
SIGHUP to this process (``exit_signals.py``: handlers are installed only while the
block is active).

A launcher that dies without running any code (SIGKILL, an OOM kill, a crash) is
covered by the parent-death signal and the lifeline (``orphan_guard.py``).  By default
(``parent_death_signal=None``) the parent-death signal is set only for launches from
the main thread, since it follows the launching thread; pass True from another
long-lived thread.

The server's output goes to its log file through ``ServerLog`` (``server_log.py``),
which masks the launch's secrets before they reach the disk.

Every server's environment carries ``INFRA_AGENT_OWNER=<launcher pid>:<token>`` (see
``procgroup.find_owned_groups``), so a later process can find and stop what a dead
launcher left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

from infra_agent.errors import ServerExitedEarly, ServerStartError
from infra_agent.safety import (
    command_secrets,
    header_secrets,
    scrub_text,
    secret_values,
)
from infra_agent.target.auth import request_headers
from infra_agent.target.exit_signals import ExitSignals
from infra_agent.target.launch import LaunchPlan, plan_launch
from infra_agent.target.launch_count import count_launch
from infra_agent.target.orphan_guard import Lifeline, parent_death_preexec
from infra_agent.target.ports import LOOPBACK, free_port
from infra_agent.target.procgroup import (
    OWNER_ENV,
    default_owner_token,
    group_alive,
    owner_mark,
    signal_group,
)
from infra_agent.target.readiness import taken_ready_port, wait_ready
from infra_agent.target.refusal import engine_reason
from infra_agent.target.server_log import ServerLog, read_tail
from infra_agent.workspace import template
from infra_agent.workspace.knobs import KnobValue
from infra_agent.workspace.models import ServerTargetSpec

_PORT_RETRIES = 3
_ADDRESS_IN_USE = "address already in use"
# Lines of the log searched for the engine's error line: a traceback is some forty lines,
# and warnings (leaked semaphores, an unclosed process group) may follow it.
_REASON_LINES = 200


class ServerProcess:
    """A launched server target.  Use as a context manager, or call start()/stop()."""

    def __init__(
        self,
        spec: ServerTargetSpec,
        knobs: Mapping[str, KnobValue],
        log_dir: str | Path,
        *,
        root: str | Path = ".",
        host: str = LOOPBACK,
        name: str = "server",
        ready_timeout_s: float | None = None,
        file: str | None = None,
        owner_token: str | None = None,
        parent_death_signal: bool | None = None,
        lifeline: bool = True,
    ) -> None:
        self.spec = spec
        self.knobs = dict(knobs)
        self.log_dir = Path(log_dir)
        self.root = Path(root).resolve()
        self.host = host
        self.name = name
        self.ready_timeout_s = spec.ready_timeout_s if ready_timeout_s is None else ready_timeout_s
        self._file = file
        # INFRA_AGENT_OWNER=<our pid>:<token> in the server's environment.
        self.owner_token = owner_token or default_owner_token()
        owner_mark(self.owner_token)  # checks the token now, not at launch
        # None: only from the main thread; a worker thread that ends would kill the server.
        self.parent_death_signal = parent_death_signal
        self.lifeline = lifeline
        self._lifeline: Lifeline | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False  # the group has been stopped; _proc is kept for pid/returncode
        self._plan: LaunchPlan | None = None
        self._port: int | None = None
        self._log_path: Path | None = None
        self._log: ServerLog | None = None
        self._exit_signals = ExitSignals()

    # ------------------------------------------------------------ surface

    @property
    def port(self) -> int:
        assert self._port is not None, "server not started"
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        assert self._plan is not None, "server not started"
        return self._plan.metrics_url

    @property
    def ready_url(self) -> str:
        assert self._plan is not None, "server not started"
        return self._plan.ready_url

    @property
    def model(self) -> str | None:
        return self.spec.model

    @property
    def request_headers(self) -> dict[str, str]:
        """Headers every request carries (``headers`` and the bearer key from ``api_key_env``)."""
        return request_headers(self.spec.api_key_env, self.spec.headers, file=self._file)

    @property
    def argv(self) -> list[str]:
        assert self._plan is not None, "server not started"
        return list(self._plan.argv)

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def pgid(self) -> int | None:
        # The leader of a new session: its group id is its pid.
        return self.pid

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server log ("" if there is none yet), secrets masked.

        A server that fails to start may print its environment or its arguments (vLLM
        lists its non-default args, ``--api-key`` included): the tail goes into error
        messages, results and the ledger, so it is masked here, where the launch's
        environment and argv are known."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        if self._log is not None and self._proc is not None and self._proc.poll() is not None:
            self._log.settle()  # its last lines may still be on their way to the file
        return self._masked(read_tail(self._log_path, n))

    def _masked(self, text: str) -> str:
        """``text`` without the launch's secrets: its environment's (the target's ``env`` included),
        the values after secret flags of its argv, and its secret header values."""
        if self._plan is None:
            return scrub_text(text)
        return scrub_text(text, self._launch_secrets())

    def _launch_secrets(self) -> list[str]:
        assert self._plan is not None
        headers = dict(self.spec.headers)
        if self.spec.api_key_env and os.environ.get(self.spec.api_key_env):
            headers["Authorization"] = f"Bearer {os.environ[self.spec.api_key_env]}"
        extra = command_secrets(self._plan.argv) + header_secrets(headers)
        return secret_values(self._plan.env, extra=extra)

    def check_alive(self) -> None:
        """Raise ``ServerStartError`` with the log tail if the server has exited."""
        assert self._proc is not None, "server not started"
        if self._stopped:
            raise ServerStartError(f"{self.name} was stopped", self._proc.returncode, self.log_tail(), str(self._log_path))
        code = self._proc.poll()
        if code is not None:
            raise ServerStartError(f"{self.name} exited while running", code, self.log_tail(), str(self._log_path))

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> ServerProcess:
        self._exit_signals.install()
        try:
            self.start()
        except BaseException:
            self._exit_signals.restore()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            self._exit_signals.restore()

    def start(self) -> ServerProcess:
        """Launch and wait for readiness; on failure the group is stopped before raising."""
        self.request_headers  # noqa: B018 -- a missing api_key_env variable fails before the launch
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(_PORT_RETRIES):
            self._launch(free_port(self.host))
            try:
                self._wait_ready()
                return self
            except ServerStartError as exc:
                self.stop()
                lost_port = exc.exit_code is not None and _ADDRESS_IN_USE in exc.log_tail.lower()
                if not lost_port:
                    raise
                # Not a refusal of the configuration: another process took the port.
                if not self._command_uses_port():
                    # A fixed port in the command: another port from us cannot help.
                    raise ServerStartError(
                        f"{self.name} could not bind its port: its log says the address is already in use, and the "
                        "command names a fixed port; stop the process holding it, or put {port} in the command",
                        exc.exit_code, exc.log_tail, exc.log_path,
                    ) from None
                if attempt == _PORT_RETRIES - 1:
                    raise ServerStartError(
                        f"{self.name} could not bind a port: another process took each of the {_PORT_RETRIES} free "
                        "ports it was given", exc.exit_code, exc.log_tail, exc.log_path,
                    ) from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _command_uses_port(self) -> bool:
        parts = [self.spec.command] if isinstance(self.spec.command, str) else self.spec.command
        return any("port" in template.placeholders(p) for p in parts)

    def _check_ready_url_free(self, port: int) -> None:
        """Refuse to launch when ``ready_url`` points at a loopback port someone already serves."""
        assert self._plan is not None
        taken = taken_ready_port(self._plan.ready_url, port)
        if taken is None:
            return
        raise ServerStartError(
            self._masked(f"port {taken} is already in use: {self._plan.ready_url} answers before {self.name} was "
                         "started, so readiness would be read from another process; stop it, or use {port} in the "
                         "command and ready_url"),
            None, "",
        )

    def _launch(self, port: int) -> None:
        self._port = port
        self._plan = plan_launch(self.spec, self.knobs, port, root=self.root, host=self.host, file=self._file)
        self._check_ready_url_free(port)
        env = {**self._plan.env, OWNER_ENV: owner_mark(self.owner_token)}
        pdeathsig = self.parent_death_signal
        if pdeathsig is None:
            pdeathsig = threading.current_thread() is threading.main_thread()
        preexec = parent_death_preexec() if pdeathsig else None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._log_path = self.log_dir / f"{self.name}-{stamp}-{port}.log"
        self._log = ServerLog(self._log_path, self._launch_secrets())
        adapted = f"# adapted to the installed engine: {self._plan.adapted}\n" if self._plan.adapted else ""
        self._log.note(self._masked(f"{adapted}# argv: {self._plan.argv}\n# cwd: {self._plan.cwd}\n"))
        self._proc, self._stopped = None, False
        try:
            # A pipe, not the file: ServerLog masks what the server prints before it is written.
            self._proc = subprocess.Popen(
                self._plan.argv,
                cwd=self._plan.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,  # noqa: PLW1509 -- one prctl call, nothing imported or locked (see parent_death_preexec)
            )
        except OSError as exc:
            self._log.close()
            raise ServerStartError(self._masked(f"cannot launch {self._plan.argv[0]!r}: {exc.strerror}"), None, "",
                                   str(self._log_path)) from None
        count_launch()
        assert self._proc.stdout is not None
        self._log.follow(self._proc.stdout)
        if self.lifeline:
            self._lifeline = Lifeline.start(self._proc.pid, self.spec.stop_grace_s, self._log_path)

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._plan is not None
        not_ready = wait_ready(self._proc, self._plan.ready_url, self._ready_headers(), self.ready_timeout_s)
        if not_ready is None:
            return
        if not_ready.exit_code is not None:
            raise ServerExitedEarly(self.name, not_ready.exit_code, self.log_tail(), str(self._log_path),
                                    engine_reason(self.log_tail(_REASON_LINES)))
        raise ServerStartError(
            self._masked(f"{self.name} not ready after {self.ready_timeout_s:g}s (GET {self._plan.ready_url}: "
                         f"{not_ready.last}); stopped it"),
            None,
            self.log_tail(),
            str(self._log_path),
        )

    def _ready_headers(self) -> dict[str, str]:
        # The auth headers go only to the server's own origin.
        assert self._plan is not None
        if urlsplit(self._plan.ready_url).netloc != urlsplit(self.url).netloc:
            return {}
        return self.request_headers

    def stop(self) -> int | None:
        """TERM the group, KILL it after ``stop_grace_s``; returns the leader's exit code.

        A Ctrl-C or SIGTERM that arrives while stopping escalates to SIGKILL at once
        and is re-raised only after the group is gone, so cleanup never leaves orphans.
        """
        if self._proc is None:
            return None
        if self._stopped:
            return self._proc.returncode
        pending: BaseException | None = None
        sig = signal.SIGTERM
        while True:
            try:
                self._terminate(sig)
                break
            except (KeyboardInterrupt, SystemExit) as exc:
                pending, sig = exc, signal.SIGKILL
        self._stopped = True
        if self._lifeline is not None:
            self._lifeline.disarm()
            self._lifeline = None
        if self._log is not None:
            self._log.close()  # the group is gone: the rest of its output goes to the file
        if pending is not None:
            raise pending
        return self._proc.returncode

    def _terminate(self, first: signal.Signals) -> None:
        assert self._proc is not None
        pgid = self._proc.pid
        signal_group(pgid, first)
        deadline = time.monotonic() + (self.spec.stop_grace_s if first == signal.SIGTERM else 0.0)
        # Wait for the leader and every member of its group, not just the leader:
        # a child that outlives the leader would otherwise be orphaned.
        while self._proc.poll() is None or group_alive(pgid):
            if time.monotonic() >= deadline:
                signal_group(pgid, signal.SIGKILL)
                self._proc.wait()
                deadline = time.monotonic() + 5.0
                while group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.01)
                return
            time.sleep(0.02)
