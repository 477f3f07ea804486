"""What the Ray executor asks of the cluster's nodes, and how long a task took on the way.

- ``head_affinity``: the run's progress queue (one actor) lives on the head node, so a
  worker node lost mid-run takes no other experiment's progress with it.
- ``node_alive``: the driver looks at the node running a task every few seconds; a node
  the cluster has marked dead is recorded as lost at once, while Ray re-queues the task.
- ``task_timing``: what one experiment cost beyond its own work, from four instants:
  the driver starts packing, the task is submitted, the task starts and ends on the node,
  the result is back in the driver.  The node's instants are on the node's clock: on one
  machine (the tests, ``bench/ray_overhead.py``) they are exact; across machines they are
  as good as the clocks' agreement (NTP: milliseconds).
"""

from __future__ import annotations

from typing import Any

NODE_LOOK_S = 2.0  # how often the driver asks whether a running task's node is alive
_HEAD = "node:__internal_head__"  # the resource Ray gives the head node only


def head_node_id(ray: Any) -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and _HEAD in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def head_affinity(ray: Any) -> dict[str, Any]:
    """Actor options that place an actor on the head node (soft: anywhere if there is none)."""
    head = head_node_id(ray)
    if head is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=True)}


def node_alive(ray: Any, node_id: str) -> bool:
    try:
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001 - the GCS unreachable for a moment: no news is not a loss
        return True
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in nodes)


def task_timing(task: dict[str, Any], result: dict[str, Any], back: float) -> dict[str, float]:
    """Seconds: ``pack_s`` (the sides packed on the driver), ``to_start_s`` (submitted until the
    task starts on its node: scheduling, the spec's transfer, a worker process), ``run_s`` (the
    task on the node), ``back_s`` (the task's end until its result is in the driver);
    ``overhead_s`` is their sum less ``run_s``, and ``shipped_bytes`` the packs' size."""
    out = {"pack_s": task["packed"] - task["t0"], "shipped_bytes": float(task["bytes"])}
    started, ended = result.get("started"), result.get("ended")
    if isinstance(started, (int, float)) and isinstance(ended, (int, float)):
        out.update(to_start_s=started - task["packed"], run_s=ended - started, back_s=back - ended)
        out["overhead_s"] = out["pack_s"] + out["to_start_s"] + out["back_s"]
    return out


def cluster_errors_to_stderr() -> None:
    """Send the cluster's error messages that Ray's driver prints (a node's raylet that died,
    with its log's tail) to stderr, where the run's progress goes.  Ray prints them on stdout
    whatever ``log_to_driver`` says, and ``--json`` keeps stdout for the run record alone.
    (``print_to_stdstream`` is Ray's internal printer; without it, nothing is changed.)"""
    try:
        from ray._private import worker
    except ImportError:
        return
    original = getattr(worker, "print_to_stdstream", None)
    if original is None or getattr(original, "infra_agent_stderr", False):
        return

    def to_stderr(data: dict[str, Any], ignore_prefix: bool) -> Any:
        return original({**data, "is_err": True}, ignore_prefix)

    to_stderr.infra_agent_stderr = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_stderr
