"""Starting and resuming runs: ledger, proposer, planner and executor put together.

``start_run`` checks what can be checked before anything runs (the scenarios, the
target's command, the proposer and its options, an LLM endpoint), then creates a run
record (its options are everything ``resume`` needs) and drives the loop; a mistake
found there leaves nothing in the ledger.  ``resume_run`` reloads the record (a run
whose confirmation did not confirm resumes to top that confirmation up), kills
what the dead run left (its marked processes, its worktrees), rebuilds the proposer's
state from the ledger and continues.  Ctrl-C and SIGTERM end a run cleanly: the
current experiment's processes and worktrees go, the ledger keeps every finished
experiment, the run is marked ``interrupted`` and ``RunInterrupted`` (a
``KeyboardInterrupt``) carries its record out.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from infra_agent.agent.loop import Loop
from infra_agent.agent.planner import Planner
from infra_agent.agent.progress import RunProgress
from infra_agent.agent.proposers.base import Proposer
from infra_agent.agent.run_checks import (
    check_llm_endpoint,
    check_scenarios,
    check_target_command,
)
from infra_agent.errors import ConfigError, InfraAgentError
from infra_agent.judge.process_noise import resolve as resolve_noise
from infra_agent.probes.workspace_checks import load_workspace
from infra_agent.records import RunRecord
from infra_agent.target.host_load import default_max_foreign_cpu
from infra_agent.workspace.models import Workspace

if TYPE_CHECKING:
    from infra_agent.ledger import Ledger


class RunOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    proposer: Literal["rules", "search", "llm"] = "rules"
    budget_runs: int | None = Field(8, ge=1, description="experiments after the baseline")
    budget_s: float | None = Field(None, gt=0)
    pairs: int = Field(3, ge=3, le=50, description="interleaved A/B pairs per batch of an e2e comparison (>= 3 for an "
                                                  "interval)")
    # The sequential design's cap (agent/rounds.py): batches of ``pairs`` are looked at until one
    # decides or this many pairs ran.  None: four batches.
    max_pairs: int | None = Field(None, ge=3, le=200, description="most interleaved pairs one e2e comparison may run")
    # A serving window taken while other processes used more than this many cores is run
    # again (agent/executors/worker.py); None: never.  Default: INFRA_AGENT_MAX_FOREIGN_CPU, else 0.5.
    max_foreign_cpu: float | None = Field(default_factory=default_max_foreign_cpu, ge=0)
    probe_timeout_s: float = Field(900.0, gt=0)
    check_timeout_s: float = Field(300.0, gt=0)
    scenarios: list[str] | None = None
    confirm: bool = True
    # One more round when the judge cannot decide (agent/extra_batch.py); off: a verdict per round.
    top_up: bool = True
    # Re-run the failing gates' checks once per best when the proposer has nothing to try (agent/fresh_findings.py).
    look_again: bool = True
    keep_going: bool = False
    playbook: str | None = None
    seed: int = 0
    blind: bool = False
    model: str | None = None
    base_url: str | None = None
    max_turns: int = Field(30, ge=1)
    max_tokens: int = Field(200_000, ge=1)
    # Where experiments run (agent/executors/factory.py): this machine, or Ray tasks on a cluster.
    executor: Literal["local", "ray"] = "local"
    # The spread between fresh server processes the judge adds (judge/process_noise.py): auto = calibrated.
    process_noise: Annotated[float, Field(ge=0, lt=1)] | Literal["auto", "off"] = "auto"
    # Keep servers up across experiments for knob changes where that is sound (executors/server_pool.py).
    reuse_servers: Literal["auto", "off"] = "auto"
    address: str | None = Field(None, description="the Ray cluster to join (--executor ray); None: a local instance")
    task_cpus: float | None = Field(None, gt=0, description="CPUs per experiment task (--executor ray)")
    task_gpus: float | None = Field(None, ge=0, description="GPUs per experiment task (--executor ray)")


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP ended the run; its record is marked interrupted and it can be resumed."""

    def __init__(self, run: RunRecord, root: Path) -> None:
        super().__init__(f"run {run.id} interrupted")
        self.run = run
        self.root = root  # the workspace folder


def new_run_id() -> str:
    return time.strftime("r%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def make_proposer(opts: RunOptions, ledger: Ledger | None, run_id: str, protected: list[str] | None = None) -> Proposer:
    if opts.proposer == "rules":
        from infra_agent.agent.proposers.rules import RulesProposer, load_playbook

        return RulesProposer(load_playbook(opts.playbook))
    if opts.proposer == "search":
        from infra_agent.agent.proposers.search import SearchProposer

        return SearchProposer(seed=opts.seed, blind=opts.blind)  # type: ignore[return-value]
    missing = [flag for flag, value in (("--model", opts.model), ("--base-url", opts.base_url)) if not value]
    if missing:
        raise InfraAgentError(f"--proposer llm needs --model NAME and --base-url URL (an OpenAI-compatible endpoint, "
                              f"such as http://127.0.0.1:8000/v1); missing: {', '.join(missing)}")
    assert opts.model is not None and opts.base_url is not None
    if not re.match(r"^https?://[^/\s]+", opts.base_url):
        raise ConfigError("--base-url", None, "an http:// or https:// URL of an OpenAI-compatible endpoint "
                          "(such as http://127.0.0.1:8000/v1)", opts.base_url)
    from infra_agent.agent.proposers.llm import LLMProposer

    return LLMProposer(model=opts.model, base_url=opts.base_url, max_turns=opts.max_turns, max_tokens=opts.max_tokens,  # type: ignore[return-value]
                       protected=tuple(protected or ()))


def preflight(ws: Workspace, opts: RunOptions) -> Proposer:
    """Every check that needs no server and no ledger; returns the proposer they built."""
    from infra_agent.agent.run_files import protect_playbook

    protect_playbook(ws, opts.playbook)
    check_scenarios(ws, opts.scenarios)
    check_target_command(ws)
    from infra_agent.agent.executors.factory import check_executor

    check_executor(opts)
    resolve_noise(ws.root, opts.process_noise)  # a damaged calibration stops here, before a run is recorded
    proposer = make_proposer(opts, None, "", ws.protected_patterns)
    if opts.proposer == "llm":
        assert opts.base_url is not None
        check_llm_endpoint(opts.base_url)
    return proposer


# ---------------------------------------------------------------- who runs a run

def _start_time(pid: int) -> str | None:
    """A live process's start time in clock ticks since boot (Linux), to tell a reused pid apart;
    None when there is no such process, or it has exited (a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _owner() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}


def live_owner(ledger: Ledger, run_id: str) -> int | None:
    """The pid of another process on this machine that is driving ``run_id`` now, if any."""
    owner = ledger.get_state(run_id, "owner") or {}
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or owner.get("host") != socket.gethostname():
        return None
    start = _start_time(pid)
    if start is None or (owner.get("start") is not None and start != owner.get("start")):
        return None
    return pid


def _exclude_from_git(root: Path) -> None:
    """Keep ``.infra-agent/`` (ledger, logs, worktrees) out of the user's ``git status``."""
    proc = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return
    exclude = (root / proc.stdout.strip()).resolve()
    rel = root.resolve()
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True, check=False).stdout.strip()
    # "/.infra-agent/" at the top of the repository, "/sub/dir/.infra-agent/" below it
    pattern = "/" + (rel.relative_to(Path(top).resolve()) / ".infra-agent").as_posix() + "/" if top else ".infra-agent/"
    text = exclude.read_text() if exclude.exists() else ""
    if pattern not in text.splitlines():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text(text + ("" if text.endswith("\n") or not text else "\n") + pattern + "\n")


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run like Ctrl-C, so the same cleanup runs."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


@contextmanager
def _no_interrupts() -> Iterator[None]:
    """A second Ctrl-C must not cut the cleanup short (it would leave servers behind)."""
    try:
        saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    except ValueError:  # not the main thread: signals go to the main thread anyway
        saved = {}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _drive(ws: Workspace, ledger: Ledger, run: RunRecord, console: Console | None, progress: bool,
           proposer: Proposer | None = None) -> RunRecord:
    opts = RunOptions.model_validate({k: v for k, v in run.options.items() if k in RunOptions.model_fields})
    from infra_agent.agent.executors.factory import make_executor
    from infra_agent.agent.run_files import protect_playbook

    protect_playbook(ws, opts.playbook)  # before the executor and the proposer read the protected paths

    executor = make_executor(ws, run.id, opts, ledger)
    try:
        proposer = proposer or make_proposer(opts, ledger, run.id, ws.protected_patterns)
        history = ledger.experiments(run.id)
        if hasattr(proposer, "restore"):
            proposer.restore(history)
        if hasattr(proposer, "load_messages"):
            proposer.load_messages(ledger.get_state(run.id, "llm_messages", []))
        planner = Planner(ws, ledger.probe_costs(), opts.scenarios)
    except KeyboardInterrupt:
        run.status, run.message, run.finished_at = "interrupted", "interrupted before the loop started", time.time()
        ledger.save_run(run)
        raise RunInterrupted(run, ws.root) from None
    with RunProgress(console, enabled=progress) as view, _terminate_as_interrupt():
        loop = Loop(ws, ledger, run, proposer, executor, planner, view)
        _persist_proposer(proposer, ledger, run.id, loop)
        try:
            return loop.execute()
        except KeyboardInterrupt:
            with _no_interrupts():
                found = executor.cleanup()
                if run.status != "interrupted":
                    run.status, run.message, run.finished_at = "interrupted", "interrupted", time.time()
                    ledger.save_run(run)
            view.line("interrupted: cleaned up " + (", ".join(found) if found else "nothing left running"))
            raise RunInterrupted(run, ws.root) from None
        finally:
            if run.status != "interrupted":
                with _no_interrupts():
                    executor.cleanup()


def _persist_proposer(proposer: Any, ledger: Ledger, run_id: str, loop: Loop) -> None:
    """Save an LLM conversation after every experiment, so resume continues it."""
    if not hasattr(proposer, "messages"):
        return
    observe = proposer.observe

    def observe_and_save(state: Any, exp: Any) -> None:
        observe(state, exp)
        ledger.set_state(run_id, "llm_messages", proposer.messages)

    proposer.observe = observe_and_save


def start_run(workspace: str | Path, opts: RunOptions, console: Console | None = None, progress: bool = True) -> RunRecord:
    from infra_agent.ledger import Ledger

    ws = load_workspace(workspace)
    if opts.playbook:
        # Recorded as an absolute path: a `resume` from another directory reads (and protects) the same file.
        opts = opts.model_copy(update={"playbook": str(Path(opts.playbook).expanduser().resolve())})
    proposer = preflight(ws, opts)
    _exclude_from_git(ws.root)
    run = RunRecord(id=new_run_id(), workspace=str(ws.root), proposer=opts.proposer, started_at=time.time(),
                    options=opts.model_dump(mode="json"))
    with Ledger.for_workspace(ws.root) as ledger:
        ledger.create_run(run)
        ledger.set_state(run.id, "owner", _owner())
        return _drive(ws, ledger, run, console, progress, proposer)


FINISHED = ("done", "budget")


def resume_run(workspace: str | Path, run_id: str, console: Console | None = None, progress: bool = True) -> RunRecord:
    from infra_agent.ledger import Ledger
    from infra_agent.ledger.store import LEDGER_DIR, LEDGER_FILE

    ws = load_workspace(workspace)
    db = ws.root / LEDGER_DIR / LEDGER_FILE
    if not db.is_file():
        raise InfraAgentError(f"no run {run_id!r} to resume: {ws.root} has no ledger ({db} does not exist), so no run "
                              f"was started there; start one with `infra-agent run {ws.root}`")
    with Ledger.for_workspace(ws.root) as ledger:
        run = ledger.get_run(run_id)
        if run.status in FINISHED:
            raise InfraAgentError(f"run {run_id} is finished ({run.status}: {run.message}); nothing to resume: "
                                  f"see it with `infra-agent report {run_id} -w {ws.root}`, or start a new one with "
                                  f"`infra-agent run {ws.root}`")
        pid = live_owner(ledger, run.id)
        if pid is not None:
            raise InfraAgentError(f"run {run_id} is still running in process {pid}; stop it first (Ctrl-C or "
                                  f"kill {pid}), then resume it")
        opts = RunOptions.model_validate({k: v for k, v in run.options.items() if k in RunOptions.model_fields})
        proposer = preflight(ws, opts)
        ledger.set_state(run.id, "owner", _owner())
        # Whatever the dead run left: its marked processes and its worktrees (on every node, for Ray).
        from infra_agent.agent.executors.factory import make_executor

        make_executor(ws, run.id, opts).cleanup()
        for exp in ledger.experiments(run.id):
            if not exp.finished:
                exp.status = "interrupted"
                ledger.save_experiment(exp)
        if run.status == "not_confirmed":
            # Its search is over; what it lacks is evidence: the confirmation gets one more round.
            run.options["top_up_confirmation"] = True
        run.status, run.finished_at = "running", None
        ledger.save_run(run)
        return _drive(ws, ledger, run, console, progress, proposer)
