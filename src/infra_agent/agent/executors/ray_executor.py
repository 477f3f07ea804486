"""The Ray executor: each experiment as one Ray task on a cluster; the ledger stays here.

``infra-agent run WORKSPACE --executor ray [--address ADDR]``

- **One task per experiment.** The task (``ray_task.run_experiment``) runs all of it
  on one node: the cheap gates, the kernel pair or the interleaved A/B, with both
  sides' servers started there, so an A/B's pairs share the node's drift.  Tasks are
  scheduled with Ray's ``SPREAD`` strategy, so successive experiments go to
  different nodes; each asks for the CPUs and GPUs its target needs, and for a server
  slot per server where the nodes declare slots (``ray_resources``, or
  ``--task-cpus`` / ``--task-gpus``).  ``measure`` and ``execute`` may be called from
  several threads: the driver prepares one task at a time, the tasks run side by side.
- **The driver keeps what is durable.** Worktrees, diffs, the protected-path check
  and accepted commits happen here, as in the local executor (this class is one);
  the sides travel as packed workspace folders (``ray_ship``), results come back as
  plain data, and only this process writes the SQLite ledger.
- **A lost worker is retried once** (``max_retries=1``): a second ``ray_attempt``
  event from the task says the first attempt died, and a node the cluster marks dead
  says so sooner (``ray_nodes.node_alive``); the loss goes to the progress view, to
  the run's state in the ledger (``ray_lost_workers``) and to the Feedback's
  ``meta["executor"]``, which also names the node, the task's folder there and its
  timing (``ray_nodes.task_timing``).  A task lost twice is an ``error`` experiment;
  what finished before it stays in the ledger.
- **Clean-up**: Ctrl-C cancels the task (its worker is killed, and with it the probe
  worker and servers through their parent-death signal); ``cleanup`` then runs a
  small task on every node that kills what carries the run's marker and removes the
  run's folders there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, OnEvent, Refusal
from infra_agent.agent.executors.jobs import ProbeTimeout
from infra_agent.agent.executors.local import LocalExecutor, _feedbacks
from infra_agent.agent.executors.prompt_sets import block_size, windows_per_run
from infra_agent.agent.executors.ray_nodes import (
    NODE_LOOK_S,
    cluster_errors_to_stderr,
    head_affinity,
    node_alive,
    task_timing,
)
from infra_agent.agent.executors.ray_resources import (
    Mode,
    TaskResources,
    derive,
    describe_nodes,
    describe_request,
    fits,
    with_slots,
)
from infra_agent.agent.executors.ray_ship import pack, restore_artifacts
from infra_agent.agent.executors.worktree import PatchRejected
from infra_agent.agent.planner import Plan
from infra_agent.errors import InfraAgentError
from infra_agent.records import Experiment
from infra_agent.workspace.models import Workspace

RAY_EXTRA = "pip install 'infra-agent[ray]'"
LOST_STATE = "ray_lost_workers"  # the run-state key in the ledger

Record = Callable[[str, Any], None]


class MissingExtra(InfraAgentError):
    """An optional dependency the command needs is not installed; names the extra to install."""


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MissingExtra(f"--executor ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


class RayExecutor(LocalExecutor):
    name = "ray"

    def __init__(self, workspace: Workspace, run_id: str, *, address: str | None = None,
                 resources: TaskResources | None = None, record: Record | None = None, lost: list[dict[str, Any]] | None = None,
                 **options: Any) -> None:
        super().__init__(workspace, run_id, **options)
        self.address = address
        self.resources = resources or TaskResources()
        self.record = record
        self.lost: list[dict[str, Any]] = list(lost or [])  # every loss of this run (kept across resume)
        self._events: Any = None  # the progress queue the tasks write to (one actor, for the whole run)
        self._unreachable: str | None = None  # why connecting failed: the clean-up does not wait on it again
        self._lock = threading.RLock()  # the connection, the queue, the inbox and the losses
        self._prep = threading.Lock()  # the driver's preparation of a task: one at a time
        self._inbox: dict[str, list[dict[str, Any]]] = {}  # experiment id -> its events taken from the queue

    # ------------------------------------------------------------ the cluster

    def connect(self) -> Any:
        ray = require_ray()
        with self._lock:
            if not ray.is_initialized():
                try:
                    ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                             logging_level=logging.WARNING)
                except (ConnectionError, RuntimeError, ValueError) as exc:
                    where = f"at {self.address}" if self.address else "(a new local instance)"
                    self._unreachable = (f"cannot connect to the Ray cluster {where} (--address): {exc}"
                                         f"{_auth_hint(self.address)}")
                    raise InfraAgentError(self._unreachable) from None
            cluster_errors_to_stderr()
        return ray

    def _queue(self) -> Any:
        with self._lock:
            if self._events is None:
                from ray.util.queue import Queue

                # On the head node: a worker node lost mid-run must not take every task's progress with it.
                self._events = Queue(actor_options={"num_cpus": 0, **head_affinity(require_ray())})
            return self._events

    def _options(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "timeout_s": self.timeout_s, "check_timeout_s": self.check_timeout_s,
                "percentiles": self.percentiles, "max_foreign_cpu": self.max_foreign_cpu}

    # ------------------------------------------------------------ the interface
    # Both may be called from several threads at once (experiments on different nodes at once):
    # what the driver prepares (worktrees, prompt-set blocks, packs) is prepared one at a time,
    # and the tasks run side by side.

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        def submit() -> Execution:
            with self._prep:
                if exp.role == "baseline" and exp.base_commit is None:
                    exp.base_commit = self.base_commit()
                side = self._measured_dir(exp)
                # The node's windows draw from a block of the run's prompt sets, reserved here (prompt_sets.py).
                first = self.prompt_sets.reserve(block_size(len(scenarios) * repeats, 1)) if scenarios else None
                sides = self._with_pristine({"m": side})
                task = self._prepare("measure", exp, sides, [exp.knobs], scenarios=scenarios, repeats=repeats,
                                     checks=checks, result_metrics=result_metrics, first_prompt_set=first)
            return self._run(task, exp, on_event)
        return self._guarded(exp, submit)

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        def submit() -> Execution:
            with self._prep:
                a_dir, b_dir = self._sides(exp, best)  # worktrees and the protected-path check, here
                first = None
                if plan.mode == "ab":
                    first = self.prompt_sets.reserve(block_size(len(plan.scenarios) * self.pairs,
                                                                 windows_per_run(plan.probe.config)))
                sides = self._with_pristine({"a": a_dir, "b": b_dir})
                task = self._prepare(plan.mode, exp, sides, [best.knobs, exp.knobs], plan=plan,
                                     best=_light(best), first_prompt_set=first)
            return self._run(task, exp, on_event)
        return self._guarded(exp, submit)

    def _with_pristine(self, sides: dict[str, Path]) -> dict[str, Path]:
        """``sides`` and, where one of them is not the user's tree and a check is a kernel check, the
        pristine tree as side ``p``: the node judges those checks from it, as the local executor does."""
        if not any(c.probe == "kernel" for c in self.ws.checks):
            return sides
        judged = {root for d in sides.values() if (root := self._judge_root(d)) is not None}
        return {**sides, "p": judged.pop()} if judged else sides

    def _guarded(self, exp: Experiment, submit: Callable[[], Execution]) -> Execution:
        start = time.perf_counter()
        try:
            ex = submit()
        except PatchRejected as exc:
            ex = Execution(status="rejected", error=str(exc))
        except ProbeTimeout as exc:
            ex = Execution(status="timeout", error=str(exc))
        except InfraAgentError as exc:
            ex = Execution(status="error", error=str(exc))
        except (OSError, ValueError) as exc:
            ex = Execution(status="error", error=f"running {exp.id} on Ray failed: {type(exc).__name__}: {exc}")
        ex.wall_s = time.perf_counter() - start
        return ex

    # ------------------------------------------------------------ one task

    def _prepare(self, mode: Mode, exp: Experiment, sides: dict[str, Path], knobs: list[dict[str, Any]],
                 **extra: Any) -> dict[str, Any]:
        """The task's resource request and spec (the sides packed): refused here when no node can hold it."""
        ray = self.connect()
        resolved = [self.ws.resolve_knobs(k) for k in knobs]
        nodes = ray.nodes()
        request = with_slots(self.ws, mode, derive(self.ws, mode, resolved, self.resources), nodes)
        if not fits(request, nodes):
            raise InfraAgentError(f"no node of the Ray cluster has {describe_request(request)} for {exp.id} "
                                  f"({describe_nodes(nodes)}): pass --task-cpus / --task-gpus, or add a node that has them")
        t0 = time.time()
        packs: dict[str, bytes] = {}
        ids: dict[str, str] = {}
        by_path: dict[str, str] = {}
        for key, folder in sides.items():
            real = str(folder.resolve())
            if real not in by_path:  # a knob change runs both sides from one folder: ship it once
                by_path[real] = f"p{len(by_path)}"
                packs[by_path[real]] = pack(folder)
            ids[key] = by_path[real]
        spec = {"kind": "measure" if mode == "measure" else "execute", "run_id": self.run_id, "exp": _light(exp),
                "sides": ids, "packs": packs, "yaml_name": self._yaml_name,
                "code_ids": {k: self._code_id(d) for k, d in sides.items()},
                # Empty in a fresh round (``fresh_checks``): the node runs every check again.
                "cache": {} if self.fresh else {k: (first, fb.model_dump(mode="json"))
                                                for k, (first, fb) in self._check_cache.items()},
                "options": self._options(), **extra}
        return {"request": request, "spec": spec, "t0": t0, "packed": time.time(),
                "bytes": sum(len(b) for b in packs.values())}

    def _run(self, task: dict[str, Any], exp: Experiment, on_event: OnEvent | None) -> Execution:
        ray = self.connect()
        from infra_agent.agent.executors.ray_task import run_experiment

        events = self._queue()
        remote = ray.remote(run_experiment).options(
            max_retries=1, retry_exceptions=False, scheduling_strategy="SPREAD", name=f"infra-agent {self.run_id}/{exp.id}",
            **task["request"])
        ref = remote.remote(task["spec"], events)
        attempts: list[dict[str, Any]] = []
        try:
            result = self._wait(ray, ref, events, exp, attempts, on_event)
        except KeyboardInterrupt:
            ray.cancel(ref, force=True)  # kills the worker; its probe worker and servers follow it
            # Until it is gone: a worker still running could start a server after the clean-up.
            ray.wait([ref], timeout=30)
            raise
        except ray.exceptions.RayError as exc:
            self._drain(events, exp, attempts, on_event)
            where = ", ".join(f"{a.get('ip') or a.get('host')} (node {str(a.get('node_id'))[:8]}, pid {a.get('pid')})"
                              for a in attempts) or "no node"
            if attempts and not attempts[-1].get("lost") and not isinstance(exc, ray.exceptions.RayTaskError):
                self._lose(exp, attempts[-1], None, on_event)  # a worker or node died, twice
            return Execution(status="error", error=f"the Ray task running {exp.id} failed after {len(attempts)} "
                                                   f"attempt(s), on {where}: {type(exc).__name__}: {_first_line(exc)}")
        finally:
            with self._lock:
                self._inbox.pop(exp.id, None)
        return self._result(exp, result, attempts, task_timing(task, result, time.time()))

    def _wait(self, ray: Any, ref: Any, events: Any, exp: Experiment, attempts: list[dict[str, Any]],
              on_event: OnEvent | None) -> dict[str, Any]:
        """The task's result; meanwhile its progress, and the loss of its node as soon as the
        cluster says so (Ray re-queues the task; the retry's start may be long in coming on a
        busy cluster)."""
        next_look = time.monotonic() + NODE_LOOK_S
        while True:
            done, _ = ray.wait([ref], timeout=0.25)
            self._drain(events, exp, attempts, on_event)
            if done:
                return ray.get(ref)  # type: ignore[no-any-return]
            if attempts and time.monotonic() >= next_look:
                next_look = time.monotonic() + NODE_LOOK_S
                last = attempts[-1]
                if not last.get("lost") and last.get("node_id") and not node_alive(ray, last["node_id"]):
                    last["lost"] = True
                    self._lose(exp, last, None, on_event, requeued=len(attempts) < 2)

    def _drain(self, events: Any, exp: Experiment, attempts: list[dict[str, Any]], on_event: OnEvent | None) -> None:
        with self._lock:  # one queue for the run's tasks: each thread takes its own experiment's events
            try:
                batch = events.get_nowait_batch(events.qsize()) if events.qsize() else []
            except Exception:  # noqa: BLE001 - the queue's actor died with its node: a new one for the next task
                self._events, batch = None, []
            for ev in batch:
                self._inbox.setdefault(str(ev.get("exp")), []).append(ev)
            mine = self._inbox.pop(exp.id, [])
        for ev in mine:
            if ev.get("event") == "ray_attempt":
                if attempts and attempts[-1].get("lost"):
                    self._retried(exp, ev)  # its loss is recorded already (the node was seen gone)
                elif attempts:
                    self._lose(exp, attempts[-1], ev, on_event)
                attempts.append(ev)
            elif on_event is not None:
                on_event(ev)

    def _lose(self, exp: Experiment, lost: dict[str, Any], retry: dict[str, Any] | None, on_event: OnEvent | None,
              requeued: bool = False) -> None:
        """Record that the worker running ``exp`` was lost (and where it was retried)."""
        info = {"experiment": exp.id, "node": lost.get("ip") or lost.get("host"), "node_id": lost.get("node_id"),
                "pid": lost.get("pid"), "at": time.time(),
                "retried_on": (retry.get("ip") or retry.get("host")) if retry else None,
                "retried_on_node_id": retry.get("node_id") if retry else None}
        with self._lock:
            self.lost.append(info)
            if self.record is not None:
                self.record(LOST_STATE, self.lost)
        if on_event is not None:
            then = (f"retrying it once on {info['retried_on']}" if retry else
                    "re-queued: Ray retries it once on a node that fits" if requeued else "not retried again")
            whose = "node" if requeued else "worker"
            on_event({"event": "probe", "probe": "ray", "ok": False,
                      "error": f"the {whose} running {exp.id} on {info['node']} (node {str(info['node_id'])[:8]}, pid "
                               f"{info['pid']}) was lost; {then}"})

    def _retried(self, exp: Experiment, retry: dict[str, Any]) -> None:
        with self._lock:
            for info in reversed(self.lost):
                if info["experiment"] == exp.id:
                    info["retried_on"] = retry.get("ip") or retry.get("host")
                    info["retried_on_node_id"] = retry.get("node_id")
                    break
            if self.record is not None:
                self.record(LOST_STATE, self.lost)

    def _result(self, exp: Experiment, result: dict[str, Any], attempts: list[dict[str, Any]],
                timing: dict[str, float]) -> Execution:
        data = result["execution"]
        feedbacks = [fb for side in ("candidate", "baseline") for runs in data[side].values() for fb in runs]
        feedbacks += list(data["checks"].values())
        node = result["node"]
        restore_artifacts(feedbacks, result["artifacts"], result["root"], self.jobs_dir / exp.id / "ray",
                          str(node.get("ip") or node.get("host")))
        where = {"name": "ray", "node": node.get("ip") or node.get("host"), "node_id": node.get("node_id"),
                 "host": node.get("host"), "pid": node.get("pid"), "folder": result["root"],
                 "started_at": result.get("started"), "ended_at": result.get("ended"), "timing": timing,
                 "attempts": max(len(attempts), 1), "lost": [x for x in self.lost if x["experiment"] == exp.id]}
        for fb in feedbacks:
            fb.setdefault("meta", {})["executor"] = where
        from infra_agent.feedback import Feedback

        for key, first, fb in result["cache"]:
            self._check_cache.setdefault(key, (first, Feedback.model_validate(fb)))
        return Execution(status=data["status"], error=data["error"], candidate=_feedbacks(data["candidate"]),
                         baseline=_feedbacks(data["baseline"]),
                         checks={k: Feedback.model_validate(v) for k, v in data["checks"].items()},
                         e2e_runs=data["e2e_runs"], probe_runs=data["probe_runs"], launches=data.get("launches", 0),
                         refusal=Refusal(**data["refusal"]) if data.get("refusal") else None)

    # ------------------------------------------------------------ clean-up

    def cleanup(self, exp_ids: list[str] | None = None) -> list[str]:
        """The local clean-up (worktrees, anything marked here), then the same on every node."""
        found = super().cleanup(exp_ids)
        if self._unreachable is not None and not require_ray().is_initialized():
            # ray.init already failed in this process (after its own wait): nothing was sent to
            # the cluster from here, and a second attempt would only wait as long again.
            found.append(f"the Ray nodes were not cleaned: {self._unreachable}")
            return found
        try:
            ray = self.connect()
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from infra_agent.agent.executors.ray_task import clean_node

            task = ray.remote(clean_node)
            refs = [task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(self.run_id, exp_ids) for n in ray.nodes() if n.get("Alive")]
            for out in ray.get(refs, timeout=120):
                where = out["node"].get("ip") or out["node"].get("host")
                if out["killed"]:
                    found.append(f"{out['killed']} process(es) of {self.run_id} on {where}")
                found += [f"{path} on {where}" for path in out["removed"]]
        except InfraAgentError as exc:
            found.append(f"the Ray nodes were not cleaned: {exc}")
        except Exception as exc:  # noqa: BLE001 - a node that died mid clean-up: say so, the run's record stands
            found.append(f"the Ray nodes were not all cleaned: {type(exc).__name__}: {_first_line(exc)}")
        if exp_ids is None and self._events is not None:  # the run is over: its progress queue goes
            try:
                require_ray().kill(self._events.actor)
            except Exception:  # noqa: BLE001, S110 - gone already
                pass
            self._events = None
        return found


def _light(exp: Experiment) -> Experiment:
    """What a task needs of an experiment (ids, knobs, change): its Feedback stays here."""
    return exp.model_copy(update={"feedback": None, "baseline_feedback": None, "checks": {}, "verdict": None})


def _auth_hint(address: str | None) -> str:
    """What to try when joining a cluster by its address fails.  ``ray start`` turns token
    authentication on whenever ``~/.ray/auth_token`` exists (a local ``ray.init()`` writes
    one), but a driver sends its token to an address named explicitly only when
    ``RAY_AUTH_MODE=token`` says so (``auto`` and a new local instance need no setting);
    without it the connection fails after Ray's wait as if no cluster were there."""
    if address in (None, "", "auto") or os.environ.get("RAY_AUTH_MODE"):
        return ""
    return ("; if the cluster uses token authentication (ray start turns it on where ~/.ray/auth_token exists), run "
            "the driver with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__
