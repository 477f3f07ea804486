"""The node side of the Ray executor: one experiment, whole, inside one Ray task.

The task unpacks each side's workspace folder in a folder of its own on the node
(``<tmp>/infra-agent-ray/<run>/<experiment>/attempt-*``) and runs the local
executor's ``execute`` or ``measure`` over those copies: the same worker
subprocesses, process groups, timeouts and experiment markers as on one machine.
So an interleaved A/B keeps both servers on this node for the whole job (the
judge's pairing holds), and whatever a lost attempt left behind carries its marker.

Nothing here touches the ledger: the task returns plain data (the Execution, the
checks it ran, the artifacts it wrote) and the driver records it.  Progress events
go back through a Ray queue, first among them ``ray_attempt``, which is how the
driver sees that an attempt was lost and Ray retried it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution
from infra_agent.agent.executors.cleanup import kill_marked
from infra_agent.agent.executors.local import LocalExecutor
from infra_agent.agent.executors.prompt_sets import GivenBlock
from infra_agent.agent.executors.ray_ship import collect_artifacts, unpack
from infra_agent.feedback import Feedback
from infra_agent.records import Experiment
from infra_agent.workspace.models import Workspace

NODE_DIR = "infra-agent-ray"


def node_base(run_id: str) -> Path:
    return Path(tempfile.gettempdir()) / NODE_DIR / run_id


class NodeExecutor(LocalExecutor):
    """The local executor over the copies a driver shipped: no git here, the driver did it."""

    def __init__(self, workspace: Workspace, run_id: str, jobs_dir: Path, sides: dict[str, Path],
                 code_ids: dict[str, str], cache: dict[str, tuple[str, Feedback]], first_prompt_set: int | None = None,
                 **options: Any) -> None:
        super().__init__(workspace, run_id, **options)
        self.jobs_dir = jobs_dir
        if first_prompt_set is not None:  # the block of the run's prompt sets the driver reserved
            self.prompt_sets = GivenBlock(first_prompt_set)
        self.sides = sides
        self.code_ids = {str(sides[k].resolve()): v for k, v in code_ids.items()}
        self._check_cache = dict(cache)

    def _sides(self, exp: Experiment, best: Experiment) -> tuple[Path, Path]:
        return self.sides["a"], self.sides["b"]

    def _measured_dir(self, exp: Experiment) -> Path:
        return self.sides["m"]

    def _judge_root(self, ws_dir: Path) -> Path | None:
        # No git on a node: the driver ships the pristine tree (side "p") with every task whose
        # sides carry code under a kernel check.  The workspace here was loaded from the candidate's
        # copy, so "not the user's tree" cannot tell code under test from the pristine code.
        return self.sides.get("p")

    def base_commit(self) -> str | None:
        return None  # the driver recorded it before shipping

    def _code_id(self, ws_dir: Path) -> str:
        # The cache key the driver would compute for the folder this one was copied from.
        return self.code_ids[str(ws_dir.resolve())]

    def finalize(self, exp: Experiment, accepted: bool, message: str) -> str | None:
        return None  # commits are made on the driver, from its own worktree

    def new_cache_entries(self, before: set[str]) -> list[tuple[str, str, dict[str, Any]]]:
        return [(k, first, fb.model_dump(mode="json")) for k, (first, fb) in self._check_cache.items() if k not in before]


def node_info() -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "ip": None, "node_id": None}
    try:
        import ray

        ctx = ray.get_runtime_context()
        info["node_id"] = ctx.get_node_id()
        info["ip"] = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001, S110 - outside a Ray worker (a direct call in a test): host and pid suffice
        pass
    return info


def _emit(events: Any, ev: dict[str, Any]) -> None:
    if events is None:
        return
    try:
        events.put_nowait(ev)
    except Exception:  # noqa: BLE001, S110 - progress only: a driver that went away must not fail the experiment
        pass


def run_experiment(spec: dict[str, Any], events: Any = None) -> dict[str, Any]:
    """The Ray task: ``spec`` as ``RayExecutor`` builds it; returns plain data for the driver."""
    started = time.time()  # on the node's clock: the driver times the task by it (ray_nodes.task_timing)
    exp: Experiment = spec["exp"]
    run_id = spec["run_id"]
    marker = f"{run_id}/{exp.id}"
    node = node_info()
    root = node_base(run_id) / exp.id / f"attempt-{os.getpid()}-{time.time_ns()}"
    _emit(events, {"event": "ray_attempt", "exp": exp.id, **node})
    # A lost attempt's servers die with their worker (parent-death signal); anything that
    # escaped carries the experiment's marker.
    kill_marked(marker)
    cwd = os.getcwd()
    try:
        # Nothing of the driver's machine is assumed here: the task, its probe workers and its
        # servers run in the task's folder (a Ray worker starts in the folder its node was started in).
        root.mkdir(parents=True, exist_ok=True)
        os.chdir(root)
        copies: dict[str, Path] = {}
        sides: dict[str, Path] = {}
        for side, pack_id in spec["sides"].items():
            if pack_id not in copies:
                copies[pack_id] = unpack(spec["packs"][pack_id], root / "ws" / pack_id)
            sides[side] = copies[pack_id]
        from infra_agent.probes.workspace_checks import load_workspace

        ws = load_workspace(sides["m" if spec["kind"] == "measure" else "b"] / spec["yaml_name"])
        cache = {k: (first, Feedback.model_validate(fb)) for k, (first, fb) in spec["cache"].items()}
        runner = NodeExecutor(ws, run_id, root / "jobs", sides, spec["code_ids"], cache, spec.get("first_prompt_set"),
                              **spec["options"])

        def on_event(ev: dict[str, Any]) -> None:
            _emit(events, {**ev, "exp": exp.id})

        if spec["kind"] == "measure":
            ex = runner.measure(exp, spec["scenarios"], spec["repeats"], spec["checks"], on_event,
                                result_metrics=spec.get("result_metrics"))
        else:
            ex = runner.execute(exp, spec["plan"], spec["best"], on_event)
        data = execution_data(ex)
        feedbacks = [fb for side in ("candidate", "baseline") for runs in data[side].values() for fb in runs]
        feedbacks += list(data["checks"].values())
        return {"execution": data, "artifacts": collect_artifacts(feedbacks, root), "root": str(root), "node": node,
                "cache": runner.new_cache_entries(set(cache)), "started": started, "ended": time.time()}
    except Exception as exc:  # noqa: BLE001 - a copy that would not unpack or load: the experiment's error, named here
        where = node.get("ip") or node.get("host")
        error = f"{exp.id} could not run on node {where} ({root}): {type(exc).__name__}: {exc}"
        return {"execution": execution_data(Execution(status="error", error=error)), "artifacts": {}, "root": str(root),
                "node": node, "cache": [], "started": started, "ended": time.time()}
    finally:
        kill_marked(marker)
        os.chdir(cwd)  # the worker process runs other tasks after this one
        shutil.rmtree(root, ignore_errors=True)


def execution_data(ex: Execution) -> dict[str, Any]:
    def side(s: dict[str, list[Feedback]]) -> dict[str, list[dict[str, Any]]]:
        return {k: [fb.model_dump(mode="json") for fb in v] for k, v in s.items()}

    return {"status": ex.status, "error": ex.error, "candidate": side(ex.candidate), "baseline": side(ex.baseline),
            "checks": {k: fb.model_dump(mode="json") for k, fb in ex.checks.items()}, "e2e_runs": ex.e2e_runs,
            "probe_runs": ex.probe_runs, "launches": ex.launches,
            "refusal": None if ex.refusal is None else dataclasses.asdict(ex.refusal)}


def clean_node(run_id: str, exp_ids: list[str] | None) -> dict[str, Any]:
    """The clean-up task, one per node: kill the run's (or the experiments') marked processes
    and remove their folders on this node."""
    killed = 0
    prefixes = [f"{run_id}/"] if exp_ids is None else [f"{run_id}/{e}" for e in exp_ids]
    for prefix in prefixes:
        killed += kill_marked(prefix)
    base = node_base(run_id)
    targets = [base] if exp_ids is None else [base / e for e in exp_ids]
    # An attempt's folder left behind (its worker was lost) is worth naming; empty parents are not.
    removed = [str(t) for t in targets if t.exists() and any(t.rglob("attempt-*"))]
    for t in targets:
        shutil.rmtree(t, ignore_errors=True)
    return {"node": node_info(), "killed": killed, "removed": removed}


__all__ = ["NodeExecutor", "clean_node", "execution_data", "run_experiment"]
