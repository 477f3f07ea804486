"""Which executor a run uses: ``local`` (subprocesses on this machine) or ``ray`` (a cluster).

The run's options (``RunOptions``: ``executor``, ``address``, ``task_cpus``,
``task_gpus``) are stored with the run, so ``resume`` gets the same executor, and
cleans up through it (on every node, for Ray) before it continues.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from infra_agent.agent.executors.local import LocalExecutor
from infra_agent.workspace.models import Workspace


def make_executor(ws: Workspace, run_id: str, opts: Any, ledger: Any | None = None) -> LocalExecutor:
    """The executor ``opts`` names; ``ledger`` (driver side) receives what the executor records."""
    common: dict[str, Any] = {"pairs": opts.pairs, "timeout_s": opts.probe_timeout_s, "check_timeout_s": opts.check_timeout_s,
                              "max_foreign_cpu": getattr(opts, "max_foreign_cpu", "default")}
    if getattr(opts, "executor", "local") != "ray":
        return LocalExecutor(ws, run_id, reuse_servers=reuse_allowed(ws, opts)[0], **common)
    from infra_agent.agent.executors.ray_executor import (
        LOST_STATE,
        RayExecutor,
        require_ray,
    )
    from infra_agent.agent.executors.ray_resources import TaskResources

    require_ray()
    record: Callable[[str, Any], None] | None = None
    lost: list[dict[str, Any]] = []
    if ledger is not None:
        lost = list(ledger.get_state(run_id, LOST_STATE, []) or [])

        def record(key: str, value: Any) -> None:
            ledger.set_state(run_id, key, value)

    return RayExecutor(ws, run_id, address=opts.address, resources=TaskResources(cpus=opts.task_cpus, gpus=opts.task_gpus),
                       record=record, lost=lost, **common)


def reuse_allowed(ws: Workspace, opts: Any) -> tuple[bool, str]:
    """Whether the local executor keeps servers across experiments (``--reuse-servers``), and why."""
    if getattr(opts, "reuse_servers", "auto") == "off":
        return False, "--reuse-servers off"
    if getattr(opts, "executor", "local") == "ray":
        return False, "the Ray executor launches per task"
    from infra_agent.judge.process_noise import reuse_servers

    return reuse_servers(ws.root, getattr(opts, "process_noise", "auto"))


def check_executor(opts: Any) -> None:
    """Before a run starts: the executor's package is installed (one line naming the extra otherwise)."""
    if getattr(opts, "executor", "local") == "ray":
        from infra_agent.agent.executors.ray_executor import require_ray

        require_ray()
