"""The local executor: experiments as subprocesses on this machine.

- Knob changes rewrite the launch: the candidate side starts the workspace target with
  the candidate's knob values.
- Code changes go to a git worktree (``worktree.Worktrees``), checked against the
  protected paths after they are applied; the baseline side runs from a worktree of the
  current best commit, so both sides run committed code.
- Every probe run is a worker subprocess (``worker.py``) in its own process group, with
  a timeout: a hung probe is killed with its group and everything marked with its
  experiment, recorded as a timeout, and the loop goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, Executor, OnEvent
from infra_agent.agent.executors.cleanup import MARKER_ENV, PARENT_ENV, kill_marked
from infra_agent.agent.executors.protect import check_changes
from infra_agent.agent.executors.worktree import PatchRejected, Worktrees
from infra_agent.agent.experiment import Experiment
from infra_agent.agent.planner import Plan
from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback
from infra_agent.workspace import WORKSPACE_FILE
from infra_agent.workspace.models import Workspace


class ProbeTimeout(InfraAgentError):
    pass


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, workspace: Workspace, run_id: str, *, pairs: int = 3, timeout_s: float = 900.0,
                 check_timeout_s: float = 300.0, percentiles: list[float] | None = None) -> None:
        self.ws = workspace
        self.run_id = run_id
        self.pairs = pairs
        self.timeout_s = timeout_s
        self.check_timeout_s = check_timeout_s
        self.percentiles = percentiles or [50.0, 90.0, 99.0]
        self.jobs_dir = workspace.root / ".infra-agent" / "runs" / run_id
        self._wt: Worktrees | None = None
        self._open: dict[str, list[str]] = {}  # experiment id -> worktree names
        # (check, rendered config, code) -> (experiment id, Feedback): a check already run on
        # the same configuration of the same code is not run again (kernel checks cost seconds).
        self._check_cache: dict[str, tuple[str, Feedback]] = {}
        self._yaml_name = workspace.source.name if workspace.source else WORKSPACE_FILE

    # ------------------------------------------------------------ worktrees

    @property
    def worktrees(self) -> Worktrees:
        if self._wt is None:
            self._wt = Worktrees(self.ws.root, self.run_id)
        return self._wt

    def base_commit(self) -> str | None:
        try:
            return self.worktrees.head()
        except InfraAgentError:
            return None

    def _sides(self, exp: Experiment, best: Experiment) -> tuple[Path, Path]:
        """The workspace folders of the baseline (A: ``best``) and candidate (B: ``exp``) sides.

        A side runs from the user's tree only while no code is involved; any commit or
        diff puts both sides in worktrees, so both run committed code."""
        code = bool(exp.change.diff and exp.change.diff.strip())
        a_commit = best.commit
        b_commit = exp.commit if (exp.commit and not code) else a_commit
        if not code and a_commit is None and b_commit is None:
            return self.ws.root, self.ws.root
        wt = self.worktrees
        head = wt.head()
        dirs = []
        for label, commit in (("base", a_commit or head), ("cand", b_commit or head)):
            name = f"{exp.id}-{label}"
            path = wt.create(name, commit)
            self._open.setdefault(exp.id, []).append(name)
            dirs.append(path)
        if code:
            changes = wt.apply(dirs[1], exp.change.diff or "")
            check_changes(dirs[1], wt.workspace_rel, changes, self.ws.protected_patterns)
            exp.base_commit = a_commit or head
        return wt.workspace_in(dirs[0]), wt.workspace_in(dirs[1])

    # ------------------------------------------------------------ jobs

    def _job(self, exp_id: str, job: dict[str, Any], timeout_s: float, on_event: OnEvent | None) -> dict[str, Any]:
        d = self.jobs_dir / exp_id
        d.mkdir(parents=True, exist_ok=True)
        n = len(list(d.glob("job-*.json")))
        job_path, result_path = d / f"job-{n}.json", d / f"result-{n}.json"
        job_path.write_text(json.dumps({**job, "workdir": str(d / f"out-{n}")}, default=str))
        marker = f"{self.run_id}/{exp_id}"
        env = {**os.environ, MARKER_ENV: marker, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        with (d / f"worker-{n}.log").open("wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "infra_agent.agent.executors.worker", str(job_path), str(result_path)],
                                    stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        reader = threading.Thread(target=_forward, args=(proc, on_event), daemon=True)
        reader.start()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            kill_marked(marker)
            raise ProbeTimeout(f"{job['kind']} job timed out after {timeout_s:g} s; killed its process group "
                               f"and the servers it started") from None
        except BaseException:
            _kill(proc)
            kill_marked(marker)
            raise
        finally:
            reader.join(timeout=2)
        kill_marked(marker)  # a server that outlived a crashed worker
        if not result_path.exists():
            tail = (d / f"worker-{n}.log").read_text(errors="replace")[-2000:]
            raise InfraAgentError(f"the probe worker exited {proc.returncode} without a result\n{tail}")
        return dict(json.loads(result_path.read_text()))

    def _probe(self, exp_id: str, ws_dir: Path, check_name: str, knobs: dict[str, Any], config: dict[str, Any] | None,
               on_event: OnEvent | None) -> Feedback:
        check = self.ws.check(check_name)
        cfg = {**check.render(knobs), **(config or {})}
        key = json.dumps([check_name, check.probe, cfg, _code_id(ws_dir)], sort_keys=True, default=str)
        if key in self._check_cache:
            first, cached = self._check_cache[key]
            return cached.model_copy(update={"meta": {**cached.meta, "reused_from": first}})
        out = self._job(exp_id, {"kind": "probe", "probe": check.probe, "config": cfg, "workspace": str(ws_dir / self._yaml_name),
                                 "knobs": knobs}, self.check_timeout_s, on_event)
        if "feedback" not in out:
            raise InfraAgentError(out.get("error", "probe worker failed"))
        fb = Feedback.model_validate(out["feedback"])
        self._check_cache[key] = (exp_id, fb)
        return fb

    def remember_check(self, exp_id: str, check_name: str, knobs: dict[str, Any], fb: Feedback) -> None:
        """Seed the cache from the ledger (resume) with a check run on the user's tree."""
        check = self.ws.check(check_name)
        key = json.dumps([check_name, check.probe, check.render(knobs), _code_id(self.ws.root)], sort_keys=True, default=str)
        self._check_cache.setdefault(key, (exp_id, fb))

    # ------------------------------------------------------------ the interface

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        start = time.perf_counter()
        ex = Execution(status="done")
        try:
            for name in checks:
                ex.checks[name] = self._probe(exp.id, self.ws.root, name, exp.knobs, None, on_event)
                ex.probe_runs += 1
            if scenarios:
                out = self._job(exp.id, {"kind": "repeat", "workspace": str(self.ws.source), "knobs": exp.knobs,
                                         "scenarios": scenarios, "repeats": repeats, "percentiles": self.percentiles,
                                         "result_metrics": result_metrics}, self.timeout_s, on_event)
                ex.candidate = _feedbacks(out.get("b", {}))
                ex.e2e_runs += sum(len(v) for v in ex.candidate.values())
                if out.get("error"):
                    ex.status, ex.error = "error", str(out["error"])
        except ProbeTimeout as exc:
            ex.status, ex.error = "timeout", str(exc)
        except InfraAgentError as exc:
            ex.status, ex.error = "error", str(exc)
        ex.wall_s = time.perf_counter() - start
        return ex

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        start = time.perf_counter()
        ex = Execution(status="done")
        try:
            a_dir, b_dir = self._sides(exp, best)
            for name in plan.pre_checks:
                fb = self._probe(exp.id, b_dir, name, exp.knobs, None, on_event)
                ex.checks[name] = fb
                ex.probe_runs += 1
                if not fb.ok:
                    ex.status, ex.error = "rejected", f"cheap gate {name!r} failed before any e2e run: {fb.error}"
                    return ex
            if plan.mode == "pair":
                assert plan.check is not None
                extra = {k: v for k, v in plan.probe.config.items() if k == "mode"}
                ex.baseline[plan.check] = [self._probe(exp.id, a_dir, plan.check, best.knobs, extra, on_event)]
                ex.candidate[plan.check] = [self._probe(exp.id, b_dir, plan.check, exp.knobs, extra, on_event)]
                ex.probe_runs += 2
            else:
                out = self._job(exp.id, {"kind": "ab", "workspace_a": str(a_dir / self._yaml_name),
                                         "workspace_b": str(b_dir / self._yaml_name), "knobs_a": best.knobs,
                                         "knobs_b": exp.knobs, "scenarios": plan.scenarios, "pairs": self.pairs,
                                         "percentiles": self.percentiles, "result_metrics": plan.result_metrics},
                                self.timeout_s, on_event)
                ex.baseline, ex.candidate = _feedbacks(out.get("a", {})), _feedbacks(out.get("b", {}))
                ex.e2e_runs = sum(len(v) for v in ex.baseline.values()) + sum(len(v) for v in ex.candidate.values())
                ex.probe_runs += ex.e2e_runs
                if out.get("error"):
                    ex.status, ex.error = "error", str(out["error"])
        except PatchRejected as exc:
            ex.status, ex.error = "rejected", str(exc)
        except ProbeTimeout as exc:
            ex.status, ex.error = "timeout", str(exc)
        except InfraAgentError as exc:
            ex.status, ex.error = "error", str(exc)
        finally:
            ex.wall_s = time.perf_counter() - start
        return ex

    def finalize(self, exp: Experiment, accepted: bool, message: str) -> str | None:
        names = self._open.pop(exp.id, [])
        commit = None
        try:
            if accepted and f"{exp.id}-cand" in names and exp.change.diff:
                wt = self.worktrees
                commit = wt.commit(wt.base_dir / f"{exp.id}-cand", message)
                wt.ensure_run_branch(exp.base_commit or commit)
                wt.advance_run_branch(commit)
        finally:
            for name in names:
                self.worktrees.remove(name)
        return commit

    def cleanup(self, exp_ids: list[str] | None = None) -> list[str]:
        """Kill marked processes and remove worktrees; returns what was found."""
        found: list[str] = []
        prefix = f"{self.run_id}/" if exp_ids is None else None
        for p in ([prefix] if prefix else [f"{self.run_id}/{e}" for e in exp_ids or []]):
            n = kill_marked(p)
            if n:
                found.append(f"{n} process(es) of {p}")
        if self._wt is not None or (self.ws.root / ".infra-agent" / "worktrees" / self.run_id).exists():
            try:
                left = self.worktrees.leftovers()
                self.worktrees.remove_all()
                found += left
            except InfraAgentError:
                pass
        self._open.clear()
        return found


def _code_id(ws_dir: Path) -> str:
    """What code a workspace folder holds: its commit when it is a clean git checkout, else its path."""
    import subprocess as sp

    head = sp.run(["git", "rev-parse", "HEAD"], cwd=ws_dir, capture_output=True, text=True, check=False)
    dirty = sp.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ws_dir, capture_output=True, text=True,
                   check=False)
    if head.returncode == 0 and dirty.returncode == 0 and not dirty.stdout.strip():
        return head.stdout.strip()
    return str(ws_dir.resolve())


def _feedbacks(side: dict[str, list[Any]]) -> dict[str, list[Feedback]]:
    return {k: [Feedback.model_validate(f) for f in v] for k, v in side.items()}


def _forward(proc: subprocess.Popen[bytes], on_event: OnEvent | None) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if on_event is None:
            continue
        try:
            on_event(json.loads(line))
        except (ValueError, TypeError):
            continue


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
