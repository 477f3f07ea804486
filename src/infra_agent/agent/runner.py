"""Starting and resuming runs: ledger, proposer, planner and executor put together.

``start_run`` creates a run record (its options are everything ``resume`` needs) and
drives the loop; ``resume_run`` reloads the record, kills what the dead run left (its
marked processes, its worktrees), rebuilds the proposer's state from the ledger and
continues.  Ctrl-C and SIGTERM end a run cleanly: the current experiment's processes
and worktrees go, the ledger keeps every finished experiment, and the run can resume.
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console

from infra_agent.agent.executors.local import LocalExecutor
from infra_agent.agent.experiment import RunRecord
from infra_agent.agent.loop import Loop
from infra_agent.agent.planner import Planner
from infra_agent.agent.progress import RunProgress
from infra_agent.agent.proposers.base import Proposer
from infra_agent.errors import ConfigError, InfraAgentError
from infra_agent.workspace import load_workspace


class RunOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    proposer: Literal["rules", "search", "llm"] = "rules"
    budget_runs: int | None = Field(8, ge=1, description="experiments after the baseline")
    budget_s: float | None = Field(None, gt=0)
    pairs: int = Field(3, ge=3, le=50, description="interleaved A/B pairs per e2e comparison (>= 3 for an interval)")
    probe_timeout_s: float = Field(900.0, gt=0)
    check_timeout_s: float = Field(300.0, gt=0)
    scenarios: list[str] | None = None
    confirm: bool = True
    keep_going: bool = False
    playbook: str | None = None
    seed: int = 0
    blind: bool = False
    model: str | None = None
    base_url: str | None = None
    max_turns: int = Field(30, ge=1)
    max_tokens: int = Field(200_000, ge=1)


def new_run_id() -> str:
    return time.strftime("r%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def make_proposer(opts: RunOptions, ledger: Any, run_id: str, protected: list[str] | None = None) -> Proposer:
    if opts.proposer == "rules":
        from infra_agent.agent.proposers.rules import RulesProposer, load_playbook

        return RulesProposer(load_playbook(opts.playbook))
    if opts.proposer == "search":
        from infra_agent.agent.proposers.search import SearchProposer

        return SearchProposer(seed=opts.seed, blind=opts.blind)  # type: ignore[return-value]
    from infra_agent.agent.proposers.llm import LLMProposer

    if not opts.model or not opts.base_url:
        raise ConfigError("--proposer llm", "model/base_url", "--model NAME and --base-url URL of an OpenAI-compatible endpoint",
                          {"model": opts.model, "base_url": opts.base_url})
    return LLMProposer(model=opts.model, base_url=opts.base_url, max_turns=opts.max_turns, max_tokens=opts.max_tokens,  # type: ignore[return-value]
                       protected=tuple(protected or ()))


def _exclude_from_git(root: Path) -> None:
    """Keep ``.infra-agent/`` (ledger, logs, worktrees) out of the user's ``git status``."""
    proc = subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return
    exclude = (root / proc.stdout.strip()).resolve()
    rel = root.resolve()
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True, check=False).stdout.strip()
    pattern = "/" + str(rel.relative_to(Path(top).resolve()) / ".infra-agent").lstrip("./") + "/" if top else ".infra-agent/"
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


def _drive(ws: Any, ledger: Any, run: RunRecord, console: Console | None, progress: bool) -> RunRecord:
    opts = RunOptions.model_validate({k: v for k, v in run.options.items() if k in RunOptions.model_fields})
    executor = LocalExecutor(ws, run.id, pairs=opts.pairs, timeout_s=opts.probe_timeout_s, check_timeout_s=opts.check_timeout_s)
    proposer = make_proposer(opts, ledger, run.id, ws.protected_patterns)
    history = ledger.experiments(run.id)
    if hasattr(proposer, "restore"):
        proposer.restore(history)
    if hasattr(proposer, "load_messages"):
        proposer.load_messages(ledger.get_state(run.id, "llm_messages", []))
    planner = Planner(ws, ledger.probe_costs(), opts.scenarios)
    with RunProgress(console, enabled=progress) as view, _terminate_as_interrupt():
        loop = Loop(ws, ledger, run, proposer, executor, planner, view)
        _persist_proposer(proposer, ledger, run.id, loop)
        try:
            return loop.execute()
        except KeyboardInterrupt:
            found = executor.cleanup()
            view.line("interrupted: cleaned up " + (", ".join(found) if found else "nothing left running")
                      + f"; resume with `infra-agent resume {run.id}`")
            raise
        finally:
            if run.status != "interrupted":
                executor.cleanup()


def _persist_proposer(proposer: Any, ledger: Any, run_id: str, loop: Loop) -> None:
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
    for name in opts.scenarios or []:
        ws.scenario(name)
    _exclude_from_git(ws.root)
    run = RunRecord(id=new_run_id(), workspace=str(ws.root), proposer=opts.proposer, started_at=time.time(),
                    options=opts.model_dump(mode="json"))
    with Ledger.for_workspace(ws.root) as ledger:
        ledger.create_run(run)
        return _drive(ws, ledger, run, console, progress)


def resume_run(workspace: str | Path, run_id: str, console: Console | None = None, progress: bool = True) -> RunRecord:
    from infra_agent.ledger import Ledger

    ws = load_workspace(workspace)
    with Ledger.for_workspace(ws.root) as ledger:
        run = ledger.get_run(run_id)
        if run.status == "done":
            raise InfraAgentError(f"run {run_id} is finished ({run.message}); start a new one with `infra-agent run`")
        # Whatever the dead run left: its marked processes and its worktrees.
        LocalExecutor(ws, run.id).cleanup()
        for exp in ledger.experiments(run.id):
            if not exp.finished:
                exp.status = "interrupted"
                ledger.save_experiment(exp)
        run.status, run.finished_at = "running", None
        ledger.save_run(run)
        return _drive(ws, ledger, run, console, progress)
