"""Screening before any launch: a broken constraint, an oversubscribed machine and a no-op
(an alias of the parent's value, or the same rendered launch) are refused with a message that
names the knob, the value, the limit and where the limit comes from.  Through the loop, such
a step is recorded as ``rejected`` and its launch never starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from infra_agent.agent.executors.cleanup import marked_pids
from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.agent.screening import screen
from infra_agent.ledger import Ledger
from infra_agent.records import Change, Experiment, Hypothesis, Step
from infra_agent.workspace import load_workspace
from infra_agent.workspace.models import Workspace

from .loop_workspace import git, make_workspace

CORES = len(os.sched_getaffinity(0))

WORKSPACE = """\
target:
  kind: server
  command: serve --port {port} --threads {threads} --seqs {seqs} --budget {budget} --kv {kv}
  env: {TOKENS: "{budget}"}
knobs:
  threads: {type: int, min: 0, max: 1024, default: 1, resource: threads, per_process: 2, components: [runtime]}
  seqs: {type: int, min: 1, max: 4096, default: 256, components: [engine.scheduler]}
  budget: {type: int, min: 16, max: 1048576, default: 8192, components: [engine.scheduler]}
  kv: {type: choice, choices: [auto, bfloat16, fp8], default: auto, aliases: {auto: bfloat16}, components: [engine.cache]}
  unused: {type: int, min: 1, max: 64, default: 4, components: [engine]}
constraints: ["budget >= seqs"]
scenarios:
  chat: {dataset: {kind: random, input_len: 8, output_len: 8}, num_requests: 4}
"""


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    (tmp_path / "infra-agent.yaml").write_text(WORKSPACE)
    return load_workspace(tmp_path)


def base(ws: Workspace) -> Experiment:
    return Experiment(id="e0", run_id="r1", seq=0, role="baseline", status="done", knobs=ws.resolve_knobs(),
                      hypothesis=Hypothesis(statement="baseline", metric="output_throughput", direction="higher"))


def step(**knobs: object) -> Step:
    return Step(hypothesis=Hypothesis(statement="s", metric="output_throughput", direction="higher"),
                change=Change(knobs=knobs))


def test_a_broken_constraint_is_refused(ws: Workspace) -> None:
    knobs, why = screen(ws, step(budget=20), base(ws), [])
    assert knobs["budget"] == 20
    assert why == ("the change cannot run: it breaks the constraint 'budget >= seqs' (constraints.0 in infra-agent.yaml): "
                   "budget=20 < seqs=256")


def test_an_oversubscribing_thread_count_is_refused(ws: Workspace) -> None:
    _, why = screen(ws, step(threads=448), base(ws), [])
    assert why is not None and why.startswith(
        f"the change cannot run: it oversubscribes the machine: threads=448 x 2 processes > {CORES} cores (os.sched_getaffinity")
    # What the machine allows runs (threads x 2 processes within the cores; the default is 1).
    assert screen(ws, step(threads=0), base(ws), [])[1] is None
    if CORES >= 4:
        assert screen(ws, step(threads=CORES // 2), base(ws), [])[1] is None


def test_the_machine_override_sets_the_limit(tmp_path: Path) -> None:
    (tmp_path / "infra-agent.yaml").write_text(WORKSPACE + "machine: {cores: 64}\n")
    ws = load_workspace(tmp_path)
    assert screen(ws, step(threads=32), base(ws), [])[1] is None
    _, why = screen(ws, step(threads=33), base(ws), [])
    assert why is not None and "threads=33 x 2 processes > 64 cores (machine.cores in infra-agent.yaml)" in why


def test_an_alias_of_the_parents_value_is_a_no_op(ws: Workspace) -> None:
    _, why = screen(ws, step(kv="bfloat16"), base(ws), [])
    assert why == ("the change changes nothing: kv=bfloat16 is an alias of auto, the parent's value "
                   "(knobs.kv.aliases in infra-agent.yaml)")
    assert screen(ws, step(kv="fp8"), base(ws), [])[1] is None
    # Beside a real change, an alias is harmless: the step runs.
    assert screen(ws, step(kv="bfloat16", seqs=128), base(ws), [])[1] is None


def test_the_same_rendered_launch_is_a_no_op(ws: Workspace) -> None:
    _, why = screen(ws, step(unused=8), base(ws), [])
    assert why is not None and why.startswith("the change changes nothing: with unused=8 the launch renders exactly as e0's")
    # A knob the env renders is seen.
    assert screen(ws, step(budget=16384), base(ws), [])[1] is None


def test_the_same_change_already_tried_is_still_refused(ws: Workspace) -> None:
    b = base(ws)
    tried = Experiment(id="e1", run_id="r1", seq=1, parent="e0", status="done", change=Change(knobs={"seqs": 128}),
                       knobs={**b.knobs, "seqs": 128}, hypothesis=step().hypothesis)
    _, why = screen(ws, step(seqs="128"), b, [b, tried])
    assert why == "the same change was already tried on e0 in experiment e1 (done)"


# ---------------------------------------------------------------- through the loop

# The launch of a refused configuration would fail loudly: it leaves a marker and exits 1.
GUARD = '''\
import os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if (int(args["--budget"]) < int(args["--max-running"]) or args["--kv"] == "bfloat16"
        or int(args["--threads"]) * 2 > len(os.sched_getaffinity(0))):
    open("LAUNCHED-A-REFUSED-CONFIG", "a").write(" ".join(sys.argv) + "\\n")
    sys.exit(1)
sys.argv = [sys.argv[0], "--port", args["--port"], "--max-running", args["--max-running"], "--torch-threads", args["--threads"]]
exec(open("serve.py").read())
'''


@pytest.mark.slow
def test_the_loop_records_refused_steps_as_rejected_and_launches_nothing(tmp_path: Path) -> None:
    root = make_workspace(tmp_path / "ws", command=[sys.executable, "guard.py", "--port", "{port}", "--max-running", "{max_running}",
                                                    "--budget", "{budget}", "--kv", "{kv}", "--threads", "{threads}"])
    spec = yaml.safe_load((root / "infra-agent.yaml").read_text())
    spec["knobs"].update({
        "budget": {"type": "int", "min": 1, "max": 64, "default": 8, "components": ["engine.scheduler"]},
        "kv": {"type": "choice", "choices": ["auto", "bfloat16"], "default": "auto", "aliases": {"auto": "bfloat16"},
               "components": ["engine.cache"]},
        "threads": {"type": "int", "min": 0, "max": 1024, "default": 0, "resource": "threads", "per_process": 2,
                    "components": ["runtime"]},
    })
    spec["constraints"] = ["budget >= max_running"]
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (root / "guard.py").write_text(GUARD)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "guarded launch")
    playbook = tmp_path / "playbook.yaml"
    hyp = "hypothesis: {statement: 'it pays', metric: output_throughput, direction: higher}"
    playbook.write_text(
        "rules:\n"
        f"  - name: past-the-budget\n    change: {{knob: [max_running], set: 32}}\n    {hyp}\n"
        f"  - name: alias\n    change: {{knob: [kv], set: bfloat16}}\n    {hyp}\n"
        f"  - name: threads\n    change: {{knob: [threads], set: 448}}\n    {hyp}\n")
    run = start_run(root, RunOptions(proposer="rules", playbook=str(playbook), budget_runs=3, confirm=False,
                                     look_again=False, top_up=False), progress=False)
    with Ledger.for_workspace(root) as ledger:
        exps = {e.change.description or str(e.change.knobs): e for e in ledger.experiments(run.id) if e.role == "experiment"}
    rejected = [e for e in exps.values() if e.status == "rejected"]
    assert len(rejected) == 3, [(e.change.knobs, e.status, e.error) for e in exps.values()]
    errors = {next(iter(e.change.knobs)): e.error or "" for e in rejected}
    assert "breaks the constraint 'budget >= max_running'" in errors["max_running"] and "max_running=32" in errors["max_running"]
    assert "kv=bfloat16 is an alias of auto" in errors["kv"]
    assert "oversubscribes the machine: threads=448 x 2 processes" in errors["threads"]
    assert all(e.probe is None and e.cost.e2e_runs == 0 for e in rejected)
    assert not (root / "LAUNCHED-A-REFUSED-CONFIG").exists()  # no refused configuration ever launched
    assert marked_pids(run.id + "/") == []
