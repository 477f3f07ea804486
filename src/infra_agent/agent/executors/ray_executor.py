"""The Ray executor: each experiment as one Ray task on a cluster; the ledger stays here.

``infra-agent run WORKSPACE --executor ray [--address ADDR]``

- **One task per experiment.** The task (``ray_task.run_experiment``) runs all of it
  on one node: the cheap gates, the kernel pair or the interleaved A/B, with both
  sides' servers started there, so an A/B's pairs share the node's drift.  Tasks are
  scheduled with Ray's ``SPREAD`` strategy, so successive experiments go to
  different nodes; each asks for the CPUs and GPUs its target needs
  (``ray_resources``, or ``--task-cpus`` / ``--task-gpus``).
- **The driver keeps what is durable.** Worktrees, diffs, the protected-path check
  and accepted commits happen here, as in the local executor (this class is one);
  the sides travel as packed workspace folders (``ray_ship``), results come back as
  plain data, and only this process writes the SQLite ledger.
- **A lost worker is retried once** (``max_retries=1``): a second ``ray_attempt``
  event from the task says the first attempt died; the loss goes to the progress
  view, to the run's state in the ledger (``ray_lost_workers``) and to the
  Feedback's ``meta["executor"]``.  A task lost twice is an ``error`` experiment;
  what finished before it stays in the ledger.
- **Clean-up**: Ctrl-C cancels the task (its worker is killed, and with it the probe
  worker and servers through their parent-death signal); ``cleanup`` then runs a
  small task on every node that kills what carries the run's marker and removes the
  run's folders there.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, OnEvent, Refusal
from infra_agent.agent.executors.jobs import ProbeTimeout
from infra_agent.agent.executors.local import LocalExecutor, _feedbacks
from infra_agent.agent.executors.prompt_sets import block_size, windows_per_run
from infra_agent.agent.executors.ray_resources import (
    Mode,
    TaskResources,
    derive,
    describe_nodes,
    fits,
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

    # ------------------------------------------------------------ the cluster

    def connect(self) -> Any:
        ray = require_ray()
        if not ray.is_initialized():
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False,
                         logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = f"at {self.address}" if self.address else "(a new local instance)"
                self._unreachable = f"cannot connect to the Ray cluster {where} (--address): {exc}{_auth_hint(self.address)}"
                raise InfraAgentError(self._unreachable) from None
        return ray

    def _queue(self) -> Any:
        if self._events is None:
            from ray.util.queue import Queue

            self._events = Queue(actor_options={"num_cpus": 0})
        return self._events

    def _options(self) -> dict[str, Any]:
        return {"pairs": self.pairs, "timeout_s": self.timeout_s, "check_timeout_s": self.check_timeout_s,
                "percentiles": self.percentiles, "max_foreign_cpu": self.max_foreign_cpu}

    # ------------------------------------------------------------ the interface

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        def submit() -> Execution:
            if exp.role == "baseline" and exp.base_commit is None:
                exp.base_commit = self.base_commit()
            side = self._measured_dir(exp)
            # The node's windows draw from a block of the run's prompt sets, reserved here (prompt_sets.py).
            first = self.prompt_sets.reserve(block_size(len(scenarios) * repeats, 1)) if scenarios else None
            return self._submit("measure", exp, {"m": side}, [exp.knobs], on_event, scenarios=scenarios,
                                repeats=repeats, checks=checks, result_metrics=result_metrics, first_prompt_set=first)
        return self._guarded(exp, submit)

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        def submit() -> Execution:
            a_dir, b_dir = self._sides(exp, best)  # worktrees and the protected-path check, here
            first = None
            if plan.mode == "ab":
                first = self.prompt_sets.reserve(block_size(len(plan.scenarios) * self.pairs,
                                                             windows_per_run(plan.probe.config)))
            return self._submit(plan.mode, exp, {"a": a_dir, "b": b_dir}, [best.knobs, exp.knobs], on_event,
                                plan=plan, best=_light(best), first_prompt_set=first)
        return self._guarded(exp, submit)

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

    def _submit(self, mode: Mode, exp: Experiment, sides: dict[str, Path], knobs: list[dict[str, Any]],
                on_event: OnEvent | None, **extra: Any) -> Execution:
        ray = self.connect()
        from infra_agent.agent.executors.ray_task import run_experiment

        resolved = [self.ws.resolve_knobs(k) for k in knobs]
        request = derive(self.ws, mode, resolved, self.resources)
        nodes = ray.nodes()
        if not fits(request, nodes):
            raise InfraAgentError(f"no node of the Ray cluster has {request['num_cpus']:g} CPU and {request['num_gpus']:g} "
                                  f"GPU for {exp.id} ({describe_nodes(nodes)}): pass --task-cpus / --task-gpus, or add "
                                  "a node that has them")
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
        events = self._queue()
        task = ray.remote(run_experiment).options(
            max_retries=1, retry_exceptions=False, scheduling_strategy="SPREAD", name=f"infra-agent {self.run_id}/{exp.id}",
            **request)
        ref = task.remote(spec, events)
        attempts: list[dict[str, Any]] = []
        try:
            while True:
                done, _ = ray.wait([ref], timeout=0.25)
                self._drain(events, exp, attempts, on_event)
                if done:
                    break
            result = ray.get(ref)
        except KeyboardInterrupt:
            ray.cancel(ref, force=True)  # kills the worker; its probe worker and servers follow it
            # Until it is gone: a worker still running could start a server after the clean-up.
            ray.wait([ref], timeout=30)
            raise
        except ray.exceptions.RayError as exc:
            self._drain(events, exp, attempts, on_event)
            where = ", ".join(f"{a.get('ip') or a.get('host')} (pid {a.get('pid')})" for a in attempts) or "no node"
            if attempts and not isinstance(exc, ray.exceptions.RayTaskError):  # a worker or node died, twice
                self._lose(exp, attempts[-1], None, on_event)
            return Execution(status="error", error=f"the Ray task running {exp.id} failed after {len(attempts)} "
                                                   f"attempt(s), on {where}: {type(exc).__name__}: {_first_line(exc)}")
        return self._result(exp, result, attempts)

    def _drain(self, events: Any, exp: Experiment, attempts: list[dict[str, Any]], on_event: OnEvent | None) -> None:
        try:
            batch = events.get_nowait_batch(events.qsize()) if events.qsize() else []
        except Exception:  # noqa: BLE001 - the queue's actor died with its node: a new one for the next task
            self._events = None
            return
        for ev in batch:
            if ev.get("exp") != exp.id:
                continue  # a late event of a task cancelled before this one
            if ev.get("event") == "ray_attempt":
                if attempts:
                    self._lose(exp, attempts[-1], ev, on_event)
                attempts.append(ev)
            elif on_event is not None:
                on_event(ev)

    def _lose(self, exp: Experiment, lost: dict[str, Any], retry: dict[str, Any] | None, on_event: OnEvent | None) -> None:
        """Record that the worker running ``exp`` was lost (and where it was retried)."""
        info = {"experiment": exp.id, "node": lost.get("ip") or lost.get("host"), "node_id": lost.get("node_id"),
                "pid": lost.get("pid"), "at": time.time(),
                "retried_on": (retry.get("ip") or retry.get("host")) if retry else None}
        self.lost.append(info)
        if self.record is not None:
            self.record(LOST_STATE, self.lost)
        if on_event is not None:
            then = f"retrying it once on {info['retried_on']}" if retry else "not retried again"
            on_event({"event": "probe", "probe": "ray", "ok": False,
                      "error": f"the worker running {exp.id} on {info['node']} (pid {info['pid']}) was lost; {then}"})

    def _result(self, exp: Experiment, result: dict[str, Any], attempts: list[dict[str, Any]]) -> Execution:
        data = result["execution"]
        feedbacks = [fb for side in ("candidate", "baseline") for runs in data[side].values() for fb in runs]
        feedbacks += list(data["checks"].values())
        node = result["node"]
        restore_artifacts(feedbacks, result["artifacts"], result["root"], self.jobs_dir / exp.id / "ray",
                          str(node.get("ip") or node.get("host")))
        where = {"name": "ray", "node": node.get("ip") or node.get("host"), "node_id": node.get("node_id"),
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
