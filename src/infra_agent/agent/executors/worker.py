"""The probe worker: one job (a probe run, or an interleaved A/B) in a process of its own.

``python -m infra_agent.agent.executors.worker JOB.json RESULT.json``

The executor starts it in a new process group with a parent-death signal, so a
timeout kills it (and, through the servers' own parent-death signal and the
experiment marker in their environment, what it launched), and a killed loop takes
it down.  It prints one JSON event per line on stdout (progress) and writes its
result atomically, so a result file is either whole or absent.

Jobs:
- ``probe``: ``{probe, config, workspace, knobs, workdir}`` -> ``{"feedback": ...}``
- ``ab``: ``{workspace_a, workspace_b, knobs_a, knobs_b, scenarios, pairs, workdir,
  result_metrics, percentiles}`` -> ``{"a": {scenario: [feedback per run]}, "b": ...}``.
  Both servers stay up for the whole job; runs alternate A B, B A, ... per scenario.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any


def _event(**data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def run_probe_job(job: dict[str, Any]) -> dict[str, Any]:
    from infra_agent.probes.base import ProbeContext, get_probe
    from infra_agent.workspace import load_workspace

    ws = load_workspace(job["workspace"]) if job.get("workspace") else None
    if ws is not None:
        # Paths in a check's config (a kernel spec) are relative to the workspace.
        os.chdir(ws.root)
    probe = get_probe(job["probe"])()
    ctx = ProbeContext(workdir=Path(job["workdir"]), workspace=ws, knobs=dict(job.get("knobs") or {}), progress=False)
    fb = probe.execute(job.get("config") or {}, ctx)
    _event(event="probe", probe=job["probe"], ok=fb.ok, error=fb.error)
    return {"feedback": fb.model_dump(mode="json")}


def run_ab_job(job: dict[str, Any]) -> dict[str, Any]:
    from infra_agent.bench.runner import default_log_dir
    from infra_agent.probes.base import ProbeContext, get_probe
    from infra_agent.target import open_target
    from infra_agent.workspace import load_workspace

    ws = {"a": load_workspace(job["workspace_a"]), "b": load_workspace(job["workspace_b"])}
    knobs = {side: ws[side].resolve_knobs(job[f"knobs_{side}"]) for side in ("a", "b")}
    workdir = Path(job["workdir"])
    out: dict[str, dict[str, list[Any]]] = {"a": {}, "b": {}}
    # The serving probe, or any probe that measures a running target per scenario (the
    # timeline probe): it gets each side's server through ctx.target.
    probe = get_probe(job.get("probe") or "serving")()
    base_cfg = {**(job.get("config") or {}), "result_metrics": job.get("result_metrics"),
                "percentiles": job.get("percentiles") or [50, 90, 99]}
    with ExitStack() as stack:
        targets = {}
        for side in ("a", "b"):
            _event(event="start", side=side)
            targets[side] = stack.enter_context(open_target(ws[side], knobs[side], default_log_dir(ws[side])))
        for scenario in job["scenarios"]:
            for i in range(int(job["pairs"])):
                order = ("a", "b") if i % 2 == 0 else ("b", "a")
                for side in order:
                    ctx = ProbeContext(workdir=workdir / f"{side}-{scenario}-{i}", workspace=ws[side], knobs=knobs[side],
                                       progress=False, target=targets[side])
                    fb = probe.execute({**base_cfg, "scenarios": [scenario]}, ctx)
                    out[side].setdefault(scenario, []).append(fb.model_dump(mode="json"))
                    thr = next((m.value for m in fb.measurements if m.name == "output_throughput" and m.summary), None)
                    _event(event="run", side=side, scenario=scenario, pair=i, ok=fb.ok, output_throughput=thr,
                           error=fb.error)
                    if not fb.ok:
                        # A dead server fails every later run the same way: stop, keep what finished.
                        return {**out, "error": f"side {side.upper()} failed in scenario {scenario}: {fb.error}"}
    return out


def run_repeat_job(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration alone: ``repeats`` windows per scenario on one server (the baseline)."""
    from infra_agent.bench.probe import ServingProbe
    from infra_agent.bench.runner import default_log_dir
    from infra_agent.probes.base import ProbeContext
    from infra_agent.target import open_target
    from infra_agent.workspace import load_workspace

    ws = load_workspace(job["workspace"])
    knobs = ws.resolve_knobs(job.get("knobs") or {})
    out: dict[str, list[Any]] = {}
    cfg = {"result_metrics": job.get("result_metrics"), "percentiles": job.get("percentiles") or [50, 90, 99]}
    _event(event="start", side="b")
    with open_target(ws, knobs, default_log_dir(ws)) as target:
        for scenario in job["scenarios"]:
            for i in range(int(job["repeats"])):
                ctx = ProbeContext(workdir=Path(job["workdir"]) / f"{scenario}-{i}", workspace=ws, knobs=knobs,
                                   progress=False, target=target)
                fb = ServingProbe().execute({**cfg, "scenarios": [scenario]}, ctx)
                out.setdefault(scenario, []).append(fb.model_dump(mode="json"))
                thr = next((m.value for m in fb.measurements if m.name == "output_throughput" and m.summary), None)
                _event(event="run", side="b", scenario=scenario, pair=i, ok=fb.ok, output_throughput=thr, error=fb.error)
                if not fb.ok:
                    return {"b": out, "error": f"scenario {scenario} failed: {fb.error}"}
    return {"b": out}


_JOBS = {"ab": run_ab_job, "repeat": run_repeat_job, "probe": run_probe_job}


def main(argv: list[str]) -> int:
    from infra_agent.agent.executors.cleanup import die_with_parent

    die_with_parent()
    job_path, result_path = Path(argv[1]), Path(argv[2])
    job = json.loads(job_path.read_text())
    try:
        result = _JOBS[job["kind"]](job)
    except Exception as exc:  # noqa: BLE001 - any failure becomes the job's error, reported by the executor
        from infra_agent.errors import InfraAgentError

        detail = str(exc) if isinstance(exc, InfraAgentError) else f"{type(exc).__name__}: {exc}"
        result = {"error": detail}
        if not isinstance(exc, InfraAgentError):
            import traceback

            result["traceback"] = traceback.format_exc()[-4000:]
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
