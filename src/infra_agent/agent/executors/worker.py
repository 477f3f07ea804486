"""The probe worker: one job (a probe run, or an interleaved A/B) in a process of its own.

``python -m infra_agent.agent.executors.worker JOB.json RESULT.json``

The executor starts it in a new process group with a parent-death signal, so a
timeout kills it (and, through the servers' own parent-death signal and the
experiment marker in their environment, what it launched), and a killed loop takes
it down.  It prints one JSON event per line on stdout (progress) and writes its
result atomically, so a result file is either whole or absent.

Every result holds ``launches``: the server processes the job started (a refused one too).

Jobs:
- ``probe``: ``{probe, config, workspace, knobs, workdir[, pristine_root]}`` -> ``{"feedback": ...}``;
  with ``pristine_root`` (a kernel check of code under test) the probe runs from that
  tree and takes only the code it judges from the workspace's (``ProbeContext.candidate_root``)
- ``ab``: ``{workspace_a, workspace_b, knobs_a, knobs_b, scenarios, pairs, workdir,
  result_metrics, percentiles, max_foreign_cpu, first_prompt_set}`` -> ``{"a": {scenario: [feedback per run]}, "b": ...,
  "discarded": [...], "max_foreign_cpu": ..., "prompt_sets_used": ...}``.  Both servers stay up for the whole job;
  runs alternate A B, B A, ... per scenario.  When B's server exits before it is ready
  (it refused its configuration), the result holds ``error`` and ``refused`` (server,
  exit_code, reason: the engine's error line, log_path) and no runs.
- ``repeat``: ``{workspace, knobs, scenarios, repeats, workdir, result_metrics, percentiles,
  max_foreign_cpu, first_prompt_set}`` -> ``{"b": {scenario: [...]}, "discarded": [...], "max_foreign_cpu": ...,
  "prompt_sets_used": ...}``.

**Prompt sets.**  Every serving window draws prompts of its own (``serving/prompt_sets.py``)
from the block of indices the executor reserved for the job (``first_prompt_set``; layout in
``executors/prompt_sets.py``): both sides of a pair the same set, every other window, a
re-run included, a new one.  ``prompt_sets_used`` says how far into the block the job drew.

**Windows under foreign load.**  A serving window records the machine's load
(``meta["host"]``, ``target/host_load.py``).  A window whose ``foreign_cpu`` (cores used
by processes outside the experiment) exceeds ``max_foreign_cpu`` (default 0.5; None never
re-runs) is run again, an A/B's whole pair in the same order so the pairing holds, at most
twice; then the last one is kept with ``meta["host"]["loaded"] = True``.  Every kept
window's ``meta["host"]`` gets ``reruns`` and ``discarded_foreign_cpu``; the discarded
windows go to ``discarded`` (side, scenario, pair, attempt, foreign_cpu, reason, host,
feedback), and each re-run prints ``{"event": "rerun", ...}``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra_agent.agent.executors.prompt_sets import (
    MAX_RERUNS,
    slot_set,
    windows_per_run,
)
from infra_agent.errors import ServerExitedEarly

if TYPE_CHECKING:
    from infra_agent.feedback import Feedback


def _event(**data: Any) -> None:
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def run_probe_job(job: dict[str, Any]) -> dict[str, Any]:
    from infra_agent.probes.base import ProbeContext, get_probe
    from infra_agent.probes.workspace_checks import load_workspace

    ws = load_workspace(job["workspace"]) if job.get("workspace") else None
    candidate_root = None
    if job.get("pristine_root") and ws is not None:
        # The judge runs from the pristine tree; the code under test is the workspace's.
        os.chdir(job["pristine_root"])
        candidate_root = ws.root
    elif ws is not None:
        # Paths in a check's config (a kernel spec) are relative to the workspace.
        os.chdir(ws.root)
    probe = get_probe(job["probe"])()
    ctx = ProbeContext(workdir=Path(job["workdir"]), workspace=ws, knobs=dict(job.get("knobs") or {}), progress=False,
                       candidate_root=candidate_root)
    fb = probe.execute(job.get("config") or {}, ctx)
    _event(event="probe", probe=job["probe"], ok=fb.ok, error=fb.error)
    return {"feedback": fb.model_dump(mode="json")}


def run_ab_job(job: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    from infra_agent.agent.executors.base import Refusal
    from infra_agent.probes.base import ProbeContext, get_probe
    from infra_agent.probes.workspace_checks import load_workspace
    from infra_agent.serving.interleave import pair_order

    ws = {"a": load_workspace(job["workspace_a"]), "b": load_workspace(job["workspace_b"])}
    knobs = {side: ws[side].resolve_knobs(job[f"knobs_{side}"]) for side in ("a", "b")}
    workdir = Path(job["workdir"])
    out: dict[str, dict[str, list[Any]]] = {"a": {}, "b": {}}
    # The serving probe, or any probe that measures a running target per scenario (the
    # timeline probe): it gets each side's server through ctx.target.
    probe = get_probe(job.get("probe") or "serving")()
    base_cfg = {**(job.get("config") or {}), "result_metrics": job.get("result_metrics"),
                "percentiles": job.get("percentiles") or [50, 90, 99]}
    limit = _limit(job)
    discarded: list[dict[str, Any]] = []
    sets = _Sets(job, len(job["scenarios"]) * int(job["pairs"]), windows_per_run(base_cfg))
    with ExitStack() as stack:
        targets = {}
        for side in ("a", "b"):
            _event(event="start", side=side, kept=_kept(job, side))
            try:
                targets[side] = stack.enter_context(_target(job, side, ws[side], knobs[side]))
            except ServerExitedEarly as exc:
                if side != "b" or not exc.refused:
                    raise  # the parent's configuration ran before: its failure is not a refusal
                return {**out, "discarded": discarded, "max_foreign_cpu": limit, "error": str(exc),
                        "refused": dataclasses.asdict(Refusal.of(exc)), **sets.used()}
        for s, scenario in enumerate(job["scenarios"]):
            for i in range(int(job["pairs"])):

                def window(side: str, attempt: int, scenario: str = scenario, i: int = i,
                           slot: int = s * int(job["pairs"]) + i) -> Feedback:
                    ctx = ProbeContext(workdir=workdir / _folder(f"{side}-{scenario}-{i}", attempt), workspace=ws[side],
                                       knobs=knobs[side], progress=False, target=targets[side],
                                       prompt_set=sets.of(slot, attempt))
                    return probe.execute({**base_cfg, "scenarios": [scenario]}, ctx)

                order = pair_order(i, "abba")
                fbs = _measure_slot(window, order, scenario, i, limit, discarded)
                for side, fb in fbs.items():
                    out[side].setdefault(scenario, []).append(fb.model_dump(mode="json"))
                    if not fb.ok:
                        # A dead server fails every later run the same way: stop, keep what finished.
                        return {**out, "discarded": discarded, "max_foreign_cpu": limit, **sets.used(),
                                "error": f"side {side.upper()} failed in scenario {scenario}: {fb.error}"}
    return {**out, "discarded": discarded, "max_foreign_cpu": limit, **sets.used()}


def run_repeat_job(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration alone: ``repeats`` windows per scenario on one server (the baseline)."""
    from infra_agent.probes.base import ProbeContext
    from infra_agent.probes.serving import ServingProbe
    from infra_agent.probes.workspace_checks import load_workspace

    ws = load_workspace(job["workspace"])
    knobs = ws.resolve_knobs(job.get("knobs") or {})
    out: dict[str, list[Any]] = {}
    cfg = {"result_metrics": job.get("result_metrics"), "percentiles": job.get("percentiles") or [50, 90, 99]}
    limit = _limit(job)
    discarded: list[dict[str, Any]] = []
    sets = _Sets(job, len(job["scenarios"]) * int(job["repeats"]), 1)
    _event(event="start", side="b", kept=_kept(job, "b"))
    with _target(job, "b", ws, knobs) as target:
        for s, scenario in enumerate(job["scenarios"]):
            for i in range(int(job["repeats"])):

                def window(side: str, attempt: int, scenario: str = scenario, i: int = i,
                           slot: int = s * int(job["repeats"]) + i) -> Feedback:
                    ctx = ProbeContext(workdir=Path(job["workdir"]) / _folder(f"{scenario}-{i}", attempt), workspace=ws,
                                       knobs=knobs, progress=False, target=target, prompt_set=sets.of(slot, attempt))
                    return ServingProbe().execute({**cfg, "scenarios": [scenario]}, ctx)

                fb = _measure_slot(window, ("b",), scenario, i, limit, discarded)["b"]
                out.setdefault(scenario, []).append(fb.model_dump(mode="json"))
                if not fb.ok:
                    return {"b": out, "discarded": discarded, "max_foreign_cpu": limit, **sets.used(),
                            "error": f"scenario {scenario} failed: {fb.error}"}
    return {"b": out, "discarded": discarded, "max_foreign_cpu": limit, **sets.used()}


class _Sets:
    """The prompt sets of one job's windows, drawn from its block (``executors/prompt_sets.py``)."""

    def __init__(self, job: dict[str, Any], slots: int, per_slot: int) -> None:
        self.first, self.slots, self.per_slot = int(job.get("first_prompt_set") or 0), slots, per_slot
        self.end = self.first  # one past the last set drawn

    def of(self, slot: int, attempt: int) -> int:
        index = slot_set(self.first, self.slots, self.per_slot, slot, attempt)
        self.end = max(self.end, index + self.per_slot)
        return index

    def used(self) -> dict[str, int]:
        return {"prompt_sets_used": self.end - self.first}


def _kept(job: dict[str, Any], side: str) -> bool:
    """The side's server was kept up from an earlier job (not started by the loop for this one)."""
    info = (job.get("attach") or {}).get(side)
    return info is not None and not info.get("launched", False)


def _target(job: dict[str, Any], side: str, ws: Any, knobs: dict[str, Any]) -> Any:
    """The side's server: the one the loop keeps up for it (``job["attach"]``), else launched here."""
    from infra_agent.serving.runner import default_log_dir
    from infra_agent.target import open_target

    info = (job.get("attach") or {}).get(side)
    if info is None:
        return open_target(ws, knobs, default_log_dir(ws))
    from infra_agent.safety import workspace_secrets
    from infra_agent.target.attached import AttachedServer

    return AttachedServer.from_job(ws.target, info, file=str(ws.source) if ws.source else None,
                                   secrets=workspace_secrets(ws))


# ------------------------------------------------------------ windows under foreign load

# MAX_RERUNS (prompt_sets.py, whose blocks hold them): re-runs per window (per pair in an A/B);
# then the last one is kept, marked loaded.


def _limit(job: dict[str, Any]) -> float | None:
    """``max_foreign_cpu`` from the job (absent: the default, target/host_load.py; None: never re-run)."""
    from infra_agent.target.host_load import default_max_foreign_cpu

    value = job["max_foreign_cpu"] if "max_foreign_cpu" in job else default_max_foreign_cpu()
    return None if value is None else float(value)


def _foreign(fb: Feedback) -> float | None:
    value = (fb.meta.get("host") or {}).get("foreign_cpu")
    return float(value) if isinstance(value, (int, float)) else None


def _over(fb: Feedback, limit: float | None) -> float | None:
    """The window's foreign CPU when it exceeds ``limit``, else None (also when unmeasured)."""
    foreign = _foreign(fb)
    return foreign if limit is not None and foreign is not None and foreign > limit else None


def _reason(foreign: float, limit: float | None) -> str:
    return f"foreign_cpu {foreign:.2f} cores > max_foreign_cpu {limit:g}"


def _folder(name: str, attempt: int) -> str:
    return f"{name}-rerun{attempt}" if attempt else name


def _measure_slot(window: Callable[[str, int], Feedback], order: tuple[str, ...], scenario: str, slot: int,
                  limit: float | None, discarded: list[dict[str, Any]]) -> dict[str, Feedback]:
    """One slot's windows (an A/B pair's two sides in ``order``, or one repeat), run again,
    whole, while any of them ran under more foreign CPU than ``limit``, at most
    ``MAX_RERUNS`` times; then the last ones are kept, the loaded ones marked.  Discarded
    windows go to ``discarded``.  Stops at a failed window (the caller reports it)."""
    for attempt in range(MAX_RERUNS + 1):
        fbs: dict[str, Feedback] = {}
        for side in order:
            fbs[side] = fb = window(side, attempt)
            _run_event(fb, side, scenario, slot, attempt)
            if not fb.ok:
                return fbs
        loaded = {side: f for side, fb in fbs.items() if (f := _over(fb, limit)) is not None}
        if not loaded or attempt == MAX_RERUNS:
            break
        worst = max(loaded, key=lambda k: loaded[k])
        why = _reason(loaded[worst], limit)
        for side, fb in fbs.items():
            reason = _reason(loaded[side], limit) if side in loaded else f"re-run with its pair: side {worst.upper()} {why}"
            discarded.append(_discard(fb, side, scenario, slot, attempt, reason))
        _event(event="rerun", scenario=scenario, pair=slot, attempt=attempt + 1, max_foreign_cpu=limit,
               foreign_cpu={k: _foreign(fb) for k, fb in fbs.items()}, reason=why)
    for side, fb in fbs.items():
        _keep(fb, attempt, side in loaded, [d["foreign_cpu"] for d in discarded
                                            if (d["side"], d["scenario"], d["pair"]) == (side, scenario, slot)])
    return fbs


def _run_event(fb: Feedback, side: str, scenario: str, pair: int, attempt: int) -> None:
    thr = next((m.value for m in fb.measurements if m.name == "output_throughput" and m.summary), None)
    _event(event="run", side=side, scenario=scenario, pair=pair, attempt=attempt, ok=fb.ok, output_throughput=thr,
           foreign_cpu=_foreign(fb), error=fb.error)


def _discard(fb: Feedback, side: str, scenario: str, pair: int, attempt: int, reason: str) -> dict[str, Any]:
    """A window measured under foreign load and run again: kept as evidence, not as a sample."""
    return {"side": side, "scenario": scenario, "pair": pair, "attempt": attempt, "foreign_cpu": _foreign(fb),
            "reason": reason, "host": fb.meta.get("host"), "feedback": fb.model_dump(mode="json")}


def _keep(fb: Feedback, reruns: int, loaded: bool, gone: list[float | None]) -> None:
    """Mark the window kept: how often its slot was re-run, the discarded windows' foreign
    CPU, and ``loaded`` when the re-runs ran out under load."""
    host = fb.meta.get("host")
    if not isinstance(host, dict):
        return  # a probe that does not sample the machine (the timeline probe)
    host["reruns"] = reruns
    host["discarded_foreign_cpu"] = gone
    if loaded:
        host["loaded"] = True


_JOBS = {"ab": run_ab_job, "repeat": run_repeat_job, "probe": run_probe_job}


def main(argv: list[str]) -> int:
    from infra_agent.agent.executors.cleanup import die_with_parent
    from infra_agent.target.launch_count import launches

    die_with_parent()
    job_path, result_path = Path(argv[1]), Path(argv[2])
    job = json.loads(job_path.read_text())
    result: dict[str, Any]
    try:
        result = _JOBS[job["kind"]](job)
    except Exception as exc:  # noqa: BLE001 - any failure becomes the job's error, reported by the executor
        from infra_agent.errors import InfraAgentError

        detail = str(exc) if isinstance(exc, InfraAgentError) else f"{type(exc).__name__}: {exc}"
        result = {"error": detail}
        if not isinstance(exc, InfraAgentError):
            import traceback

            result["traceback"] = traceback.format_exc()[-4000:]
    result["launches"] = launches()  # this process runs one job: every launch is the job's
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, result_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
