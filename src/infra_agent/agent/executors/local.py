"""The local executor: experiments as subprocesses on this machine.

- Knob changes rewrite the launch: the candidate side starts the workspace target with
  the candidate's knob values.
- Code changes go to a git worktree (``worktree.Worktrees``), checked against the
  protected paths after they are applied; the baseline side runs from a worktree of the
  current best commit, so both sides run committed code.
- Every probe run is a worker subprocess (``worker.py``) in its own process group, with
  a timeout: a hung probe is killed with its group and everything marked with its
  experiment, recorded as a timeout, and the loop goes on.
- A kernel check of code in a worktree is judged from the *pristine* tree (a worktree
  of the commit the run's baseline was measured on): the lab loads the spec, makes the
  inputs and the reference there, and runs only the kernels from the worktree, in a
  process of their own (``infra_agent.lab.worker_side``).
- Every serving window of the run draws prompts no earlier window drew: each job gets a
  block of prompt sets reserved for it (``prompt_sets.py``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from infra_agent.agent.executors.base import Execution, Executor, OnEvent, Refusal
from infra_agent.agent.executors.check_pair import run_check_pair
from infra_agent.agent.executors.cleanup import kill_marked
from infra_agent.agent.executors.jobs import ProbeTimeout, run_job
from infra_agent.agent.executors.prompt_sets import PromptSetCounter, windows_per_run
from infra_agent.agent.executors.protect import check_changes, check_judge_files
from infra_agent.agent.executors.server_pool import ServerPool
from infra_agent.agent.executors.shadowing import check_knob_env, check_shadowing
from infra_agent.agent.executors.worktree import (
    PatchRejected,
    Worktrees,
    code_id,
    repo_root,
)
from infra_agent.agent.planner import Plan
from infra_agent.errors import InfraAgentError, ServerExitedEarly
from infra_agent.feedback import Feedback
from infra_agent.records import Experiment
from infra_agent.workspace import WORKSPACE_FILE
from infra_agent.workspace.models import ServerTargetSpec, Workspace

# Built-in probes that take everything from their rendered config (never ``ctx.knobs``):
# their cached runs are shared across knob values that render the same config.
_KNOB_BLIND_PROBES = frozenset({"kernel", "command"})


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, workspace: Workspace, run_id: str, *, pairs: int = 3, timeout_s: float = 900.0,
                 check_timeout_s: float = 300.0, percentiles: list[float] | None = None,
                 max_foreign_cpu: float | None | str = "default", reuse_servers: bool = False) -> None:
        self.ws = workspace
        self.run_id = run_id
        self.pairs = pairs
        self.timeout_s = timeout_s
        self.check_timeout_s = check_timeout_s
        self.percentiles = percentiles or [50.0, 90.0, 99.0]
        # A serving window measured while other processes took more than this many cores is
        # run again (executors/worker.py); None never; "default": target/host_load.py's.
        self.max_foreign_cpu = max_foreign_cpu
        self.jobs_dir = workspace.root / ".infra-agent" / "runs" / run_id
        self._wt: Worktrees | None = None
        self._open: dict[str, list[str]] = {}  # experiment id -> worktree names
        # (check, rendered config, [knobs,] code) -> (experiment id, Feedback): a check already run
        # on the same configuration of the same code is not run again (kernel checks cost seconds).
        self._check_cache: dict[str, tuple[str, Feedback]] = {}
        self._yaml_name = workspace.source.name if workspace.source else WORKSPACE_FILE
        # The commit the baseline was measured on; kernel checks are judged from a worktree of it.
        self.pristine_commit: str | None = None
        self._pristine: Path | None = None
        # Workspace-relative files a kernel check's verdict runs (its reference's import graph) -> the check.
        self._judge_files: dict[str, str] = {}
        # Server processes the jobs started (each job's result says how many): an execution's
        # launches are the difference across it.
        self.launched = 0
        # Servers kept up across experiments for knob changes (executors/server_pool.py).
        self.pool = ServerPool() if reuse_servers and isinstance(workspace.target, ServerTargetSpec) else None
        self.prompt_sets = PromptSetCounter(self.jobs_dir)

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
        diff puts both sides in worktrees, so both run committed code.  Without a commit of
        its own, ``best`` ran the commit the baseline was measured on (``base_commit``), not
        whatever the user's HEAD has moved to since."""
        code = bool(exp.change.diff and exp.change.diff.strip())
        check_knob_env(self.ws, exp.knobs, best.knobs)
        # Resumed without measuring the baseline: the best's parent commit is the closest known.
        self.pristine_commit = self.pristine_commit or best.base_commit
        a_commit = best.commit
        b_commit = exp.commit if (exp.commit and not code) else a_commit
        if not code and a_commit is None and b_commit is None:
            return self.ws.root, self.ws.root
        wt = self.worktrees
        anchor = a_commit or best.base_commit or wt.head()
        dirs = [self._worktree(exp.id, "base", anchor), self._worktree(exp.id, "cand", b_commit or anchor)]
        if code:
            exp.base_commit = anchor
            changes = wt.apply(dirs[1], exp.change.diff or "")
            check_changes(dirs[1], wt.workspace_rel, changes, self.ws.protected_patterns)
            check_judge_files(wt.workspace_rel, changes, self._judge_files)
            check_shadowing(dirs[1], changes)
        return wt.workspace_in(dirs[0]), wt.workspace_in(dirs[1])

    def _worktree(self, exp_id: str, label: str, commit: str) -> Path:
        name = f"{exp_id}-{label}"
        path = self.worktrees.create(name, commit)
        self._open.setdefault(exp_id, []).append(name)
        return path

    def _pristine_root(self) -> Path | None:
        """The workspace folder of the pristine tree (one worktree per run, made when first needed)."""
        if self._pristine is None or not self._pristine.exists():
            path = self.worktrees.create("pristine", self.pristine_commit or self.worktrees.head())
            self._pristine = self.worktrees.workspace_in(path)
        return self._pristine

    def _judge_root(self, ws_dir: Path) -> Path | None:
        """Where a kernel check of ``ws_dir`` is judged from: the pristine tree for any worktree."""
        return None if ws_dir.resolve() == self.ws.root.resolve() else self._pristine_root()

    def _measured_dir(self, exp: Experiment) -> Path:
        """Where ``measure`` runs ``exp``: the user's tree, or a worktree of its commit (the confirmation's best)."""
        if not exp.commit:
            return self.ws.root
        name = f"{exp.id}-measure"
        path = self.worktrees.base_dir / name
        if not (name in self._open.get(exp.id, []) and path.exists()):
            path = self._worktree(exp.id, "measure", exp.commit)
        return self.worktrees.workspace_in(path)

    # ------------------------------------------------------------ jobs

    def _job(self, exp_id: str, job: dict[str, Any], timeout_s: float, on_event: OnEvent | None, what: str) -> dict[str, Any]:
        out = run_job(self.jobs_dir, self.run_id, exp_id, job, timeout_s, on_event, what)
        self.launched += int(out.get("launches") or 0)
        return out

    def _code_id(self, ws_dir: Path) -> str:
        """What code ``ws_dir`` holds (a node's copy answers with the id of the folder it was copied from)."""
        return code_id(ws_dir, ws_dir.resolve() == self.ws.root.resolve())

    def _check_key(self, check_name: str, probe: str, cfg: dict[str, Any], knobs: dict[str, Any], ws_dir: Path) -> str:
        return json.dumps([check_name, probe, cfg, None if probe in _KNOB_BLIND_PROBES else knobs,
                           self._code_id(ws_dir)], sort_keys=True, default=str)

    def _probe(self, exp_id: str, ws_dir: Path, check_name: str, knobs: dict[str, Any], config: dict[str, Any] | None,
               on_event: OnEvent | None) -> Feedback:
        check = self.ws.check(check_name)
        cfg = {**check.render(knobs), **(config or {})}
        key = self._check_key(check_name, check.probe, cfg, knobs, ws_dir)
        if key in self._check_cache and not self.fresh:
            first, cached = self._check_cache[key]
            self._note_judge_files(check_name, cached)
            return cached.model_copy(update={"meta": {**cached.meta, "reused_from": first}})
        what = f"check {check_name!r} ({check.probe} probe)"
        job = {"kind": "probe", "probe": check.probe, "config": cfg, "workspace": str(ws_dir / self._yaml_name), "knobs": knobs}
        if check.probe == "kernel" and (pristine := self._judge_root(ws_dir)) is not None:
            job["pristine_root"] = str(pristine)
        out = self._job(exp_id, job, self.check_timeout_s, on_event, what)
        if "feedback" not in out:
            raise InfraAgentError(f"{what} could not run for {exp_id} in {ws_dir}: {out.get('error', 'the probe worker failed')}")
        fb = Feedback.model_validate(out["feedback"])
        self._check_cache.setdefault(key, (exp_id, fb))
        self._note_judge_files(check_name, fb)
        return fb

    def _note_judge_files(self, check_name: str, fb: Feedback) -> None:
        for path in fb.meta.get("judge_files") or []:
            self._judge_files.setdefault(str(path), check_name)

    def remember_check(self, exp_id: str, check_name: str, knobs: dict[str, Any], fb: Feedback) -> None:
        """Seed the cache from the ledger (resume) with a check run on the user's tree."""
        check = self.ws.check(check_name)
        key = self._check_key(check_name, check.probe, check.render(knobs), knobs, self.ws.root)
        self._check_cache.setdefault(key, (exp_id, fb))
        self._note_judge_files(check_name, fb)

    def _attach(self, sides: dict[str, tuple[Path, dict[str, Any]]]
                ) -> tuple[dict[str, Any], dict[str, str], dict[str, Any] | None]:
        """Kept servers for the sides that run the user's tree (``{side: info}``), their pool
        keys, and the candidate's refusal if its server refused to start.  Sides of one
        configuration, or a job with a side in a worktree, launch their own and stop the kept ones."""
        if self.pool is None:
            return {}, {}, None
        from infra_agent.serving.runner import default_log_dir

        values = {side: self.ws.resolve_knobs(knobs) for side, (d, knobs) in sides.items()}
        keys = {side: self.pool.key(self.ws, v) for side, v in values.items()}
        if any(d.resolve() != self.ws.root.resolve() for d, _ in sides.values()) or len(set(keys.values())) < len(keys):
            self.pool.retain(set())
            return {}, {}, None
        out: dict[str, Any] = {}
        for side in sorted(values):  # "a" first: the parent's server, then the candidate's
            before = self.pool.launches
            try:
                _, server = self.pool.acquire(self.ws, values[side], set(keys.values()), default_log_dir(self.ws))
            except ServerExitedEarly as exc:
                if side != "b" or not exc.refused:
                    raise
                return out, keys, {**dataclasses.asdict(Refusal.of(exc)), "error": str(exc)}
            finally:
                self.launched += self.pool.launches - before
            # Started for this job (a configuration's first use) or kept from an earlier one: the
            # worker's progress says which.
            out[side] = {**ServerPool.attach_info(server), "launched": self.pool.launches > before}
        return out, keys, None

    def _pooled_job(self, exp_id: str, job: dict[str, Any], sides: dict[str, tuple[Path, dict[str, Any]]],
                    windows: tuple[int, int], on_event: OnEvent | None, what: str) -> dict[str, Any]:
        """A serving job on kept servers where it may; run once more on fresh ones if a kept
        server died during it (its windows are not the configuration's).  ``windows``: the
        job's (slots, windows a slot sends a side), for its block of prompt sets."""
        for attempt in (1, 2):
            attach, keys, refused = self._attach(sides)
            if refused is not None:
                return {"a": {}, "b": {}, "error": refused.pop("error"), "refused": refused}
            out = self._windows_job(exp_id, {**job, "attach": attach}, windows, on_event, what)
            dead = [keys[side] for side in attach if self.pool is not None and self.pool.dead(keys[side])]
            if not (out.get("error") and dead) or attempt == 2:
                return out
            for key in dead:
                assert self.pool is not None
                self.pool.drop(key)
                self.pool.restarts += 1
        raise AssertionError("unreachable")

    def _windows_job(self, exp_id: str, job: dict[str, Any], windows: tuple[int, int], on_event: OnEvent | None,
                     what: str) -> dict[str, Any]:
        """A job of serving windows on a block of the run's prompt sets (``prompt_sets.py``): every
        window of the run, on a kept server or a fresh one, sends prompts none before it sent."""
        return self.prompt_sets.run_block(windows, lambda first: self._job(
            exp_id, {**job, "first_prompt_set": first}, self.timeout_s, on_event, what))

    def _load_key(self) -> dict[str, Any]:
        """The job's re-run threshold for loaded windows (absent: the worker's default)."""
        return {} if self.max_foreign_cpu == "default" else {"max_foreign_cpu": self.max_foreign_cpu}

    # ------------------------------------------------------------ the interface

    def measure(self, exp: Experiment, scenarios: list[str], repeats: int, checks: list[str],
                on_event: OnEvent | None = None, result_metrics: list[str] | None = None) -> Execution:
        start, launched = time.perf_counter(), self.launched
        ex = Execution(status="done")
        try:
            if exp.role == "baseline" and exp.base_commit is None:
                exp.base_commit = self.base_commit()  # what the user's HEAD was: later worktrees start there
            if exp.role == "baseline":
                self.pristine_commit = exp.base_commit
            ws_dir = self._measured_dir(exp)
            for name in checks:
                ex.checks[name] = self._probe(exp.id, ws_dir, name, exp.knobs, None, on_event)
                ex.probe_runs += 1
            if scenarios:
                source = self.ws.source if ws_dir == self.ws.root and self.ws.source else ws_dir / self._yaml_name
                out = self._pooled_job(exp.id, {"kind": "repeat", "workspace": str(source), "knobs": exp.knobs,
                                                "scenarios": scenarios, "repeats": repeats,
                                                "percentiles": self.percentiles, **self._load_key(),
                                                "result_metrics": result_metrics}, {"b": (ws_dir, exp.knobs)},
                                       (len(scenarios) * repeats, 1), on_event, "serving windows")
                ex.candidate = _feedbacks(out.get("b", {}))
                ex.e2e_runs += sum(len(v) for v in ex.candidate.values())
                if out.get("error"):
                    ex.status, ex.error = "error", str(out["error"])
        except ProbeTimeout as exc:
            ex.status, ex.error = "timeout", str(exc)
        except InfraAgentError as exc:
            ex.status, ex.error = "error", str(exc)
        except (OSError, ValueError) as exc:
            ex.status, ex.error = "error", f"measuring {exp.id} failed: {type(exc).__name__}: {exc}"
        ex.wall_s, ex.launches = time.perf_counter() - start, self.launched - launched
        return ex

    def execute(self, exp: Experiment, plan: Plan, best: Experiment, on_event: OnEvent | None = None) -> Execution:
        start, launched = time.perf_counter(), self.launched
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
                if plan.check is None:
                    raise InfraAgentError(f"the plan runs probe {plan.probe.name!r} once per side but names no "
                                          "workspace check to run")
                # The planner's mode (check or bench), and any key a proposer set over the check's config.
                base_cfg = self.ws.check(plan.check).config
                extra = {k: v for k, v in plan.probe.config.items() if k == "mode" or base_cfg.get(k) != v}
                run_check_pair(self, exp, best, plan, (a_dir, b_dir), extra, ex, on_event)
            else:
                out = self._pooled_job(exp.id, {"kind": "ab", "probe": plan.probe.name, "config": plan.probe.config,
                                                "workspace_a": str(a_dir / self._yaml_name),
                                                "workspace_b": str(b_dir / self._yaml_name), "knobs_a": best.knobs,
                                                "knobs_b": exp.knobs, "scenarios": plan.scenarios, "pairs": self.pairs,
                                                "percentiles": self.percentiles, "result_metrics": plan.result_metrics,
                                                **self._load_key()},
                                       {"a": (a_dir, best.knobs), "b": (b_dir, exp.knobs)},
                                       (len(plan.scenarios) * self.pairs, windows_per_run(plan.probe.config)), on_event,
                                       f"interleaved A/B on {', '.join(plan.scenarios)}")
                ex.baseline, ex.candidate = _feedbacks(out.get("a", {})), _feedbacks(out.get("b", {}))
                ex.e2e_runs = sum(len(v) for v in ex.baseline.values()) + sum(len(v) for v in ex.candidate.values())
                ex.probe_runs += ex.e2e_runs
                if out.get("error"):
                    ex.status, ex.error = "error", str(out["error"])
                if out.get("refused"):
                    ex.refusal = Refusal(**out["refused"])
        except PatchRejected as exc:
            ex.status, ex.error = "rejected", str(exc)
        except ProbeTimeout as exc:
            ex.status, ex.error = "timeout", str(exc)
        except InfraAgentError as exc:
            ex.status, ex.error = "error", str(exc)
        except (OSError, ValueError) as exc:  # a full disk, a result that does not parse
            ex.status, ex.error = "error", f"running {exp.id} failed: {type(exc).__name__}: {exc}"
        finally:
            ex.wall_s, ex.launches = time.perf_counter() - start, self.launched - launched
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

    def restore(self, best: Experiment) -> None:
        """Point the run's branch at the best's commit, or remove it while nothing was committed.

        A run killed after a commit but before the ledger recorded it leaves the branch on a
        commit that is not the best's (the experiment then runs again on resume)."""
        if best.commit is None and repo_root(self.ws.root) is None:
            return
        wt = self.worktrees
        if best.commit is not None:
            wt.ensure_run_branch(best.commit)
            wt.advance_run_branch(best.commit)
        else:
            wt.delete_run_branch()

    def cleanup(self, exp_ids: list[str] | None = None) -> list[str]:
        """Kill marked processes and remove worktrees; returns what was found."""
        found: list[str] = []
        if self.pool is not None and exp_ids is None:
            kept = self.pool.close()
            if kept:
                found.append(f"{kept} server(s) kept across experiments")
        prefix = f"{self.run_id}/" if exp_ids is None else None
        for p in ([prefix] if prefix else [f"{self.run_id}/{e}" for e in exp_ids or []]):
            n = kill_marked(p)
            if n:
                found.append(f"{n} process(es) of {p}")
        if self._pristine is not None:
            self.worktrees.remove("pristine")  # this run's own, not something left behind
            self._pristine = None
        if self._wt is not None or (self.ws.root / ".infra-agent" / "worktrees" / self.run_id).exists():
            try:
                left = self.worktrees.leftovers()
                self.worktrees.remove_all()
                found += left
            except InfraAgentError:
                pass
        self._open.clear()
        return found


def _feedbacks(side: dict[str, list[Any]]) -> dict[str, list[Feedback]]:
    return {k: [Feedback.model_validate(f) for f in v] for k, v in side.items()}
