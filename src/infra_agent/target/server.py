"""``ServerProcess``: launch a server target, wait until it is ready, always stop it.

The server runs as the leader of a new session (``start_new_session=True``), so its
process group holds everything it spawns and a terminal's Ctrl-C reaches only us.
Stopping sends SIGTERM to the group, then SIGKILL after a grace period.  It runs on
every way out of the ``with`` block: normal exit, exceptions, Ctrl-C, and SIGTERM or
SIGHUP to this process (handlers are installed only while the block is active).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from infra_agent.errors import ServerStartError
from infra_agent.target.launch import LaunchPlan, plan_launch
from infra_agent.target.ports import LOOPBACK, free_port
from infra_agent.target.procgroup import group_alive, signal_group
from infra_agent.workspace.knobs import KnobValue
from infra_agent.workspace.models import ServerTargetSpec

_PORT_RETRIES = 3
_POLL_S = 0.1


class _Terminated(SystemExit):
    """SIGTERM/SIGHUP turned into an exception, so ``with`` blocks unwind and clean up."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated(128 + signum)


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
    ) -> None:
        self.spec = spec
        self.knobs = dict(knobs)
        self.log_dir = Path(log_dir)
        self.root = Path(root).resolve()
        self.host = host
        self.name = name
        self.ready_timeout_s = spec.ready_timeout_s if ready_timeout_s is None else ready_timeout_s
        self._file = file
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False  # the group has been stopped; _proc is kept for pid/returncode
        self._plan: LaunchPlan | None = None
        self._port: int | None = None
        self._log_path: Path | None = None
        self._saved_handlers: dict[int, Any] = {}

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
        """The last ``n`` lines of the server log ("" if there is none yet)."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with self._log_path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
        return "\n".join(data.splitlines()[-n:])

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
        self._install_signal_handlers()
        try:
            self.start()
        except BaseException:
            self._restore_signal_handlers()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            self._restore_signal_handlers()

    def start(self) -> ServerProcess:
        """Launch and wait for readiness; on failure the group is stopped before raising."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(_PORT_RETRIES):
            self._launch(free_port(self.host))
            try:
                self._wait_ready()
                return self
            except ServerStartError as exc:
                self.stop()
                lost_port = exc.exit_code is not None and "address already in use" in exc.log_tail.lower()
                if not lost_port or attempt == _PORT_RETRIES - 1:
                    raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _launch(self, port: int) -> None:
        self._port = port
        self._plan = plan_launch(self.spec, self.knobs, port, root=self.root, host=self.host, file=self._file)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self._log_path = self.log_dir / f"{self.name}-{stamp}-{port}.log"
        with self._log_path.open("wb") as log:
            log.write(f"# argv: {self._plan.argv}\n# cwd: {self._plan.cwd}\n".encode())
            log.flush()
            self._proc, self._stopped = None, False
            try:
                # The child keeps its own copy of the log fd; ours closes with the block.
                self._proc = subprocess.Popen(
                    self._plan.argv,
                    cwd=self._plan.cwd,
                    env=self._plan.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ServerStartError(f"cannot launch {self._plan.argv[0]!r}: {exc.strerror}", None, "", str(self._log_path)) from None

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._plan is not None
        deadline = time.monotonic() + self.ready_timeout_s
        last = "no answer yet"
        # trust_env=False: a proxy from the environment must not intercept loopback.
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ServerStartError(f"{self.name} exited before it was ready", code, self.log_tail(), str(self._log_path))
                try:
                    resp = client.get(self._plan.ready_url)
                    if resp.status_code == 200:
                        return
                    last = f"HTTP {resp.status_code}"
                except httpx.TransportError as exc:
                    last = type(exc).__name__
                if time.monotonic() >= deadline:
                    raise ServerStartError(
                        f"{self.name} not ready after {self.ready_timeout_s:g}s (GET {self._plan.ready_url}: {last}); stopped it",
                        None,
                        self.log_tail(),
                        str(self._log_path),
                    )
                time.sleep(_POLL_S)

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

    # ------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        # signal.signal only works on the main thread; elsewhere the owner of the
        # main thread is responsible for turning signals into exceptions.
        if threading.current_thread() is not threading.main_thread():
            return
        # Only default dispositions are replaced: a handler the application installed
        # (or SIG_IGN it chose) stays in charge.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._saved_handlers[sig] = signal.signal(sig, _raise_terminated)
        # Python normally maps SIGINT to KeyboardInterrupt already; an embedding host may
        # not, and the default action would kill us and orphan the server's session.
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
            self._saved_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers.clear()
