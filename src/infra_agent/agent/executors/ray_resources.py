"""What one experiment's Ray task asks the cluster for: CPUs and GPUs.

A task runs everything an experiment needs on one node: an interleaved A/B keeps
both sides' servers up for the whole job, so it needs two servers' worth; measuring
one configuration (the baseline) needs one; a kernel check pair runs one probe at a
time.  Per server, the workspace says what it needs through its launch:

- an endpoint target starts nothing: the task is the load generator alone (1 CPU);
- a server target gets 1 CPU, and GPUs when its launch asks for them: a ``device``
  knob set to ``cuda...`` (1 GPU) or ``CUDA_VISIBLE_DEVICES`` listed in ``target.env``
  (that many); on a GPU server a tensor-parallel knob (``tensor_parallel_size``,
  ``tp_size``, ``tp``) raises it to that many GPUs.

``--task-cpus`` / ``--task-gpus`` replace the derived numbers for every task (the
derivation cannot see a server that spawns its own GPU workers, for instance).

**Server slots.** A node may declare how many servers it holds at once with the custom
resource ``server_slot`` (``ray start --resources '{"server_slot": 4}'``: one per GPU on a
GPU node).  Where any live node declares it, each task of a server target also asks for
one slot per server it keeps up (two for an A/B), so two experiments never share a
server's GPU or cores, and only the nodes that declare slots run servers.  A cluster that
declares none is scheduled on CPUs and GPUs alone.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["ab", "pair", "measure"]
SLOT = "server_slot"  # the custom resource a node declares per server it can hold at once

# Knob names that say how many GPUs one server spans (vLLM, SGLang and refstack spellings).
_TP_KNOBS = ("tensor_parallel_size", "tp_size", "tp")


class TaskResources(BaseModel):
    """The override: None keeps the derived number."""

    model_config = ConfigDict(extra="forbid")

    cpus: float | None = Field(None, gt=0, description="CPUs per experiment task")
    gpus: float | None = Field(None, ge=0, description="GPUs per experiment task")


def server_gpus(ws: Any, knobs: dict[str, Any]) -> float:
    """GPUs one server of this workspace takes with these knob values (0 for an endpoint)."""
    target = ws.target
    if getattr(target, "kind", None) != "server":
        return 0.0
    gpus = 0.0
    if str(knobs.get("device", "") or "").startswith("cuda"):
        gpus = 1.0
    visible = target.env.get("CUDA_VISIBLE_DEVICES")
    if visible and "{" not in visible:
        gpus = max(gpus, float(len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])))
    if gpus:
        # Tensor parallelism spans GPUs only on a GPU server (refstack's tp runs on CPUs too).
        for name in _TP_KNOBS:
            value = knobs.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > gpus:
                gpus = float(value)
    return gpus


def derive(ws: Any, mode: Mode, knobs: list[dict[str, Any]], override: TaskResources | None = None) -> dict[str, float]:
    """``{"num_cpus": ..., "num_gpus": ...}`` for one task; ``knobs`` holds each server's values."""
    servers = 0 if getattr(ws.target, "kind", None) != "server" else (2 if mode == "ab" else 1)
    per_server = [server_gpus(ws, k) for k in knobs] or [0.0]
    if mode == "ab":
        gpus = sum(per_server[:2]) if len(per_server) >= 2 else 2 * per_server[0]
    else:
        gpus = max(per_server)
    cpus = float(max(servers, 1))
    if override is not None:
        cpus = override.cpus if override.cpus is not None else cpus
        gpus = override.gpus if override.gpus is not None else gpus
    return {"num_cpus": cpus, "num_gpus": gpus}


def with_slots(ws: Any, mode: Mode, request: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """``request`` plus the server slots the task holds, where the cluster declares any."""
    if getattr(ws.target, "kind", None) != "server" or mode == "pair":  # a kernel pair starts no server
        return request
    if not any(n.get("Alive", True) and n.get("Resources", {}).get(SLOT, 0) > 0 for n in nodes):
        return request
    return {**request, "resources": {SLOT: 2.0 if mode == "ab" else 1.0}}


def fits(request: dict[str, Any], nodes: list[dict[str, Any]]) -> bool:
    """Whether some live node of the cluster has the resources at all (a task that no node can
    ever hold would wait for ever)."""
    wanted = {"CPU": request["num_cpus"], "GPU": request["num_gpus"], **request.get("resources", {})}
    for node in nodes:
        if not node.get("Alive", True):
            continue
        res = node.get("Resources", {})
        if all(res.get(name, 0.0) >= amount for name, amount in wanted.items()):
            return True
    return False


def describe_request(request: dict[str, Any]) -> str:
    extra = "".join(f" and {v:g} {k}" for k, v in request.get("resources", {}).items())
    return f"{request['num_cpus']:g} CPU and {request['num_gpus']:g} GPU{extra}"


def describe_nodes(nodes: list[dict[str, Any]]) -> str:
    live = [n for n in nodes if n.get("Alive", True)]
    parts = []
    for n in live:
        res = n.get("Resources", {})
        slots = f", {res[SLOT]:g} {SLOT}" if res.get(SLOT) else ""
        parts.append(f"{n.get('NodeManagerAddress', '?')} ({str(n.get('NodeID', '?'))[:8]}): {res.get('CPU', 0):g} CPU, "
                     f"{res.get('GPU', 0):g} GPU{slots}")
    return "; ".join(parts) or "no live node"
