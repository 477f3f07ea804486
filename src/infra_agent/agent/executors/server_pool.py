"""Servers kept up across experiments: one launch per configuration, not one per batch.

A serving engine can take minutes to start (vLLM on a CPU: 87% of a 44-minute run was
start-up, both servers relaunched for every batch).  The pool starts a configuration's
server once, in the loop's process, and keeps it while experiments need it: the best
configuration stays up as the A side of every experiment on it and of their top-ups; a
candidate's server serves its later batches.  The worker of a batch attaches to them
(target/attached.py) instead of launching.

Only where it is sound:

- **Knob changes only.** A server's code is its folder's; a code change runs each side
  from a worktree of its own, so those still launch per batch.
- **No spread between fresh processes.** Two processes of one configuration may differ
  by an offset (stats/process_noise.py) that the pairs between them share; the loop's
  interval averages it over fresh process pairs, one per batch.  Reusing servers keeps
  one pair, so the executor reuses only where the workspace's calibration showed no
  such spread (judge/process_noise.py ``reuse_servers``).

A server found dead or not answering its ready URL before a batch is started again; a
batch during which a kept server died is run again once on fresh ones.  Only the
servers of the batch being measured stay up: any other is stopped before it starts, so
a kept server never competes for the cores or the memory with the pair being measured,
and a batch that cannot reuse (a code change) stops them all.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from infra_agent.target.attached import alive
from infra_agent.target.server import ServerProcess
from infra_agent.workspace.models import ServerTargetSpec, Workspace


class ServerPool:
    def __init__(self, ready_check_s: float = 10.0) -> None:
        self.ready_check_s = ready_check_s
        self._servers: OrderedDict[str, ServerProcess] = OrderedDict()
        self.launches = 0
        self.restarts = 0  # kept servers found dead or unready, started again

    @staticmethod
    def key(ws: Workspace, values: Mapping[str, Any]) -> str:
        """One server per (workspace folder, resolved knob values)."""
        return json.dumps([str(ws.root.resolve()), dict(values)], sort_keys=True, default=str)

    def acquire(self, ws: Workspace, values: Mapping[str, Any], keep: set[str], log_dir: Path) -> tuple[str, ServerProcess]:
        """The running server of this configuration: kept, or started now (ServerStartError
        and its subclasses propagate).  ``keep``: keys not to stop to make room."""
        k = self.key(ws, values)
        server = self._servers.get(k)
        if server is not None:
            if self.healthy(server):
                return k, server
            self.drop(k)
            self.restarts += 1
        self.retain(keep | {k})
        assert isinstance(ws.target, ServerTargetSpec)
        server = ServerProcess(ws.target, dict(values), log_dir, root=ws.root,
                               file=str(ws.source) if ws.source else None)
        self.launches += 1  # a refused launch is a launch all the same
        server.start()
        self._servers[k] = server
        return k, server

    def healthy(self, server: ServerProcess) -> bool:
        """Alive, and its ready URL answers 2xx within ``ready_check_s``."""
        pid = server.pid
        if pid is None or not alive(pid):
            return False
        try:
            with httpx.Client(timeout=self.ready_check_s, trust_env=False) as client:
                return client.get(server.ready_url, headers=server.request_headers).is_success
        except (httpx.HTTPError, OSError):
            return False

    def dead(self, k: str) -> bool:
        server = self._servers.get(k)
        return server is None or server.pid is None or not alive(server.pid)

    def drop(self, k: str) -> None:
        server = self._servers.pop(k, None)
        if server is not None:
            server.stop()

    def retain(self, keep: set[str]) -> None:
        """Stop every kept server but ``keep``'s: an idle server left beside the pair being measured
        would take memory and cores from it."""
        for k in [k for k in self._servers if k not in keep]:
            self.drop(k)

    def close(self) -> int:
        """Stop every kept server; returns how many."""
        n = len(self._servers)
        for k in list(self._servers):
            self.drop(k)
        return n

    @staticmethod
    def attach_info(server: ServerProcess) -> dict[str, Any]:
        """What a worker needs to measure the server (never its environment)."""
        return {"url": server.url, "pid": server.pid, "log_path": str(server.log_path) if server.log_path else None,
                "metrics_url": server.metrics_url, "since": time.time()}


__all__ = ["ServerPool"]
