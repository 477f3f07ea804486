"""A server another process launched and keeps: measured here, never started or stopped here.

The loop keeps a configuration's server up across experiments (agent/executors/
server_pool.py); the worker that runs a batch of windows attaches to it by its URL and
pid instead of launching one.  It behaves as a launched server does for a benchmark:
the same headers, metrics URL and model from the workspace's target, a log tail from
the server's log (secrets masked), and ``check_alive`` that fails once the process has
gone, so a window against a dead server becomes a failed result, not a hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.errors import ServerStartError
from infra_agent.target.auth import request_headers
from infra_agent.target.server_log import read_tail
from infra_agent.workspace.models import ServerTargetSpec


def process_state(pid: int) -> str | None:
    """The process's state letter from /proc (``Z`` for a zombie), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie its parent has yet to reap)."""
    return process_state(pid) not in (None, "Z", "X")


class AttachedServer:
    """A running server of the workspace's target, reached at ``url`` (pid ``pid``)."""

    def __init__(self, spec: ServerTargetSpec, url: str, pid: int, log_path: str | None, *,
                 metrics_url: str | None = None, file: str | None = None, secrets: list[str] | None = None) -> None:
        self.spec = spec
        self._url = url.rstrip("/")
        self._metrics_url = metrics_url
        self._pid = pid
        self._log_path = Path(log_path) if log_path else None
        self._file = file
        self._secrets = list(secrets or [])
        self.name = "server (kept up across experiments)"

    @classmethod
    def from_job(cls, spec: ServerTargetSpec, info: dict[str, Any], *, file: str | None = None,
                 secrets: list[str] | None = None) -> AttachedServer:
        return cls(spec, str(info["url"]), int(info["pid"]), info.get("log_path"), metrics_url=info.get("metrics_url"),
                   file=file, secrets=secrets)

    @property
    def url(self) -> str:
        return self._url

    @property
    def metrics_url(self) -> str | None:
        return self._metrics_url  # rendered by the owner at launch (it may hold the port)

    @property
    def model(self) -> str | None:
        return self.spec.model

    @property
    def request_headers(self) -> dict[str, str]:
        return request_headers(self.spec.api_key_env, self.spec.headers, file=self._file)

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._pid

    def log_tail(self, n: int = 40) -> str:
        from infra_agent.safety import scrub_text

        if self._log_path is None or not self._log_path.exists():
            return ""
        return scrub_text(read_tail(self._log_path, n), self._secrets or None)

    def check_alive(self) -> None:
        if not alive(self._pid):
            raise ServerStartError(f"{self.name} exited while running", None, self.log_tail(),
                                   str(self._log_path) if self._log_path else None)

    def __enter__(self) -> AttachedServer:
        self.check_alive()
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing: the server is its owner's to stop."""


__all__ = ["AttachedServer", "alive", "process_state"]
