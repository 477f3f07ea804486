"""``infra-agent run``: the agent loop on a workspace until its gates pass or the budget ends."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from infra_agent.cli.output import err_console, user_errors
from infra_agent.cli.runlog import drive_run

if TYPE_CHECKING:
    from infra_agent.agent.runner import RunOptions

# Options that only one proposer reads: giving one to another proposer is a mistake
# (``--model`` without ``--proposer llm`` would otherwise run the rules silently).
_PROPOSER_OPTIONS = {"playbook": ("--playbook", "rules"), "model": ("--model", "llm"), "base_url": ("--base-url", "llm"),
                     "blind": ("--blind", "search")}


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        workspace: Path = typer.Argument(Path("."), help="Workspace folder (holding infra-agent.yaml) or the file."),
        proposer: str = typer.Option("rules", "--proposer", help="Who proposes the experiments: rules (a playbook of "
                                     "finding -> change), search (Optuna over the knobs) or llm (a chat model with tools)."),
        budget_runs: int = typer.Option(8, "--budget-runs", help="Most experiments after the baseline (at least 1)."),
        budget_s: float | None = typer.Option(None, "--budget-s", help="Wall-time budget in seconds (no new experiment "
                                              "starts after it)."),
        pairs: int = typer.Option(3, "--pairs", help="Interleaved A/B pairs per batch of an end-to-end comparison (3 to 50)."),
        max_pairs: int | None = typer.Option(None, "--max-pairs", help="Most pairs one comparison may run: batches of "
                                             "--pairs are looked at (sequential design) until one decides or this many "
                                             "ran (default: 4 batches)."),
        max_foreign_cpu: str | None = typer.Option(None, "--max-foreign-cpu", help="Run a serving window again when "
                                                   "processes outside the experiment used more than this many cores "
                                                   "during it; 'off' never (default: 0.5, or "
                                                   "INFRA_AGENT_MAX_FOREIGN_CPU)."),
        scenario: list[str] = typer.Option([], "--scenario", help="Run only these scenarios (repeatable; default: those "
                                           "the criteria name)."),
        playbook: str | None = typer.Option(None, "--playbook", help="Rules playbook YAML (--proposer rules; default: "
                                            "the shipped one)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the search proposer."),
        blind: bool = typer.Option(False, "--blind", help="Search all knobs without attribution (--proposer search)."),
        model: str | None = typer.Option(None, "--model", help="Model name (--proposer llm)."),
        base_url: str | None = typer.Option(None, "--base-url", help="OpenAI-compatible endpoint, such as "
                                            "http://127.0.0.1:8000/v1 (--proposer llm); key from INFRA_AGENT_API_KEY "
                                            "or OPENAI_API_KEY."),
        probe_timeout_s: float = typer.Option(900.0, "--probe-timeout-s", help="Kill a probe run after this many seconds."),
        no_confirm: bool = typer.Option(False, "--no-confirm", help="Skip the final best-vs-baseline confirmation."),
        no_top_up: bool = typer.Option(False, "--no-top-up",
                                       help="Judge each experiment on its first round: no extra round when a verdict is undecided."),
        no_look_again: bool = typer.Option(False, "--no-look-again",
                                           help="Stop when the proposer has nothing to try, without re-running the failing "
                                                "gates' checks once for fresh findings."),
        keep_going: bool = typer.Option(False, "--keep-going", help="Go on after every gate passes, until the budget ends."),
        executor: str = typer.Option("local", "--executor", help="Where experiments run: local (subprocesses on this "
                                     "machine) or ray (one Ray task per experiment; needs infra-agent\\[ray])."),
        address: str | None = typer.Option(None, "--address", help="The Ray cluster to join, as for ray.init: auto, "
                                           "HOST:6379 or ray://HOST:10001 (--executor ray; default: a local instance)."),
        task_cpus: float | None = typer.Option(None, "--task-cpus", help="CPUs each experiment task asks for (--executor "
                                               "ray; default: 1 per server it starts)."),
        task_gpus: float | None = typer.Option(None, "--task-gpus", help="GPUs each experiment task asks for (--executor "
                                               "ray; default: derived from the target's launch)."),
        process_noise: str = typer.Option("auto", "--process-noise", help="The spread between fresh server processes "
                                          "the judge adds over each experiment's batches: auto (the workspace's "
                                          "`infra-agent calibrate` on this machine, else none), off, or a fraction "
                                          "such as 0.02."),
        reuse_servers: str = typer.Option("auto", "--reuse-servers", help="Keep a configuration's server up across "
                                          "experiments and batches for knob changes: auto (where the workspace's "
                                          "calibration shows no spread between fresh servers) or off."),
        no_report: bool = typer.Option(False, "--no-report", help="Do not write the HTML/Markdown report."),
        as_json: bool = typer.Option(False, "--json", help="Print the run record as JSON on stdout (progress goes to stderr)."),
    ) -> None:
        """Run the agent loop on a workspace until its gates pass or the budget ends.

        The workspace as given is measured first (the baseline: the gate table before);
        then the proposer's experiments run one at a time, each judged against its parent,
        until every gate passes, the budget is spent or the proposer has nothing left; the
        best configuration is then confirmed against the baseline (the gate table after).
        Everything is recorded in WORKSPACE/.infra-agent/ledger.db, and the report is
        written to WORKSPACE/.infra-agent/reports/RUN/.

        Ctrl-C stops the run cleanly (its servers and worktrees go); continue it with
        `infra-agent resume RUN -w WORKSPACE`.  Exit status: 0 when every gate in the
        final table passes (the confirmation's, where one ran), 3 when the run ended with
        a gate that does not (failed, undecided, or not confirmed: the message names
        it), 1 when the run itself failed (for instance the baseline could not be
        measured), 2 for a mistake in the command or the workspace (nothing is run), 130
        when interrupted.
        """
        with user_errors(as_json):
            from infra_agent.agent.runner import start_run
            from infra_agent.judge.process_noise import parse_setting

            opts = _run_options(max_foreign_cpu, proposer=proposer, budget_runs=budget_runs, budget_s=budget_s,
                                pairs=pairs, max_pairs=max_pairs, scenarios=list(scenario) or None, playbook=playbook,
                                seed=seed, blind=blind, model=model, base_url=base_url, probe_timeout_s=probe_timeout_s,
                                confirm=not no_confirm, top_up=not no_top_up, look_again=not no_look_again,
                                keep_going=keep_going, executor=executor, address=address, task_cpus=task_cpus,
                                task_gpus=task_gpus, process_noise=parse_setting(process_noise),
                                reuse_servers=reuse_servers)
            _check_proposer_options(proposer, {"playbook": playbook, "model": model, "base_url": base_url, "blind": blind})
            _check_ray_options(executor, {"--address": address, "--task-cpus": task_cpus, "--task-gpus": task_gpus})
            from infra_agent.agent.executors.factory import check_executor

            check_executor(opts)  # Ray missing: one line naming the extra, before anything is loaded
            check_target_installed(workspace)
        drive_run(lambda: start_run(workspace, opts, console=err_console, progress=True), workspace, no_report, as_json)


def _run_options(max_foreign_cpu: str | None, **fields: Any) -> RunOptions:
    """The run's options from the flags, a pydantic complaint named by its flag (``--pairs``)."""
    from pydantic import ValidationError

    from infra_agent.agent.runner import RunOptions
    from infra_agent.errors import ConfigError
    from infra_agent.target.host_load import parse_max_foreign_cpu

    # Absent unless given: RunOptions' default reads INFRA_AGENT_MAX_FOREIGN_CPU.
    load_opt: dict[str, float | None] = {}
    if max_foreign_cpu is not None:
        try:
            load_opt["max_foreign_cpu"] = parse_max_foreign_cpu(max_foreign_cpu)
        except ValueError:
            raise ConfigError("--max-foreign-cpu", None, "a number of cores >= 0, or off", max_foreign_cpu) from None
    try:
        return RunOptions(**fields, **load_opt)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ConfigError(f"--{str(err['loc'][0]).replace('_', '-')}", None, err["msg"].removeprefix("Input should be "),
                          err.get("input")) from None


def _check_proposer_options(proposer: str, given: dict[str, object]) -> None:
    """An option of one proposer given to another is refused (see ``_PROPOSER_OPTIONS``)."""
    from infra_agent.errors import ConfigError

    for key, value in given.items():
        flag, owner = _PROPOSER_OPTIONS[key]
        if value and proposer != owner:
            raise ConfigError(flag, None, f"--proposer {owner} ({flag} applies only to it)",
                              f"--proposer {proposer}")


def _check_ray_options(executor: str, given: dict[str, object]) -> None:
    """Flags that only the Ray executor reads, given with another executor, are refused."""
    from infra_agent.errors import ConfigError

    for flag, given_value in given.items():
        if given_value is not None and executor != "ray":
            raise ConfigError(flag, None, f"--executor ray ({flag} applies only to it)", f"--executor {executor}")


def check_target_installed(workspace: Path) -> None:
    """A refstack target in a base install: one line naming the extra (exit 2), before any
    run is recorded, instead of a baseline whose server dies before it is ready (exit 1)."""
    from infra_agent.errors import ConfigError
    from infra_agent.extras import target_needs
    from infra_agent.workspace import load_workspace

    try:
        ws = load_workspace(workspace)
    except ConfigError:
        return  # start_run reports a malformed workspace with its own message
    why = target_needs(ws.target)
    if why is not None:
        from infra_agent.errors import InfraAgentError
        from infra_agent.workspace.loader import find_workspace_file

        raise InfraAgentError(f"{find_workspace_file(workspace)}: {why}")
