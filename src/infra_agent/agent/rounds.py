"""An experiment judged in rounds: the sample-size plan, then looks after each batch of pairs.

Before an experiment runs, its plan (judge/sample_plan.py) is stated from the noise the run
has measured so far: the pairs its minimum effect needs, and the sequential design, batches
of ``--pairs`` up to ``--max-pairs`` looked at with Pocock's interval (judge/sequential.py).
After each batch the judge decides; a round that leaves the hypothesis undecided on an
interval, or a supported hypothesis with a guard undecided, gets the next batch, pooled with
the earlier ones (index-paired, so paired statistics stay paired), until a look decides or
the design's last look.  ``--no-top-up`` is the fixed design: one look at 95%.

A check the experiment is about (a pair of probe runs, one per side) is a batch of one run
per side; its design has two looks and no noise estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from infra_agent.agent.executors.base import Execution, Executor, OnEvent
from infra_agent.agent.extra_batch import run_extra_batch
from infra_agent.agent.planner import Plan, is_timed_pair
from infra_agent.feedback import Feedback
from infra_agent.judge.accept import judge, undecided_guards
from infra_agent.judge.gates import side_values
from infra_agent.judge.process_noise import ProcessNoise, tau_for
from infra_agent.judge.sample_plan import (
    SamplePlan,
    estimate_noise,
    noise_from_pairs,
    noise_from_windows,
    plan_sample,
)
from infra_agent.judge.sequential import SequentialDesign
from infra_agent.records import Experiment, GateResult

if TYPE_CHECKING:
    from infra_agent.workspace.models import Workspace


def paired_log_ratios(exp: Experiment, metric: str, scenario: str | None) -> list[float]:
    """An A/B's per-pair log ratios of ``metric`` (empty when it has no paired windows of it)."""
    if exp.feedback is None or exp.baseline_feedback is None:
        return []
    b = side_values([exp.feedback], metric, scenario)
    a = side_values([exp.baseline_feedback], metric, scenario)
    if len(a) != len(b) or len(a) < 2 or min(a + b) <= 0:
        return []
    return [math.log(bi / ai) for ai, bi in zip(a, b, strict=True)]


def serving_noise(plan: Plan, noise: ProcessNoise | None, batches: int) -> ProcessNoise | None:
    """The process term for judging ``batches`` batches of ``plan``: serving A/Bs only (each batch
    starts fresh servers); a check's pair of probe runs has no server process to differ."""
    return noise.after(batches) if noise is not None and plan.mode == "ab" else None


def sample_plan(exp: Experiment, plan: Plan, history: list[Experiment], opts: dict[str, Any],
                noise: ProcessNoise | None = None) -> SamplePlan:
    """The plan for ``exp``, from the baseline's windows and every A/B judged so far in ``history``;
    ``noise``: the spread between fresh server processes (judge/process_noise.py)."""
    h = exp.hypothesis
    sequential = bool(opts.get("top_up", True))
    batch = int(opts.get("pairs") or 3)
    if is_timed_pair(plan):
        # A timed check runs ``pairs`` interleaved rounds a batch (executors/local.py): two looks.
        return plan_sample(h.metric, h.min_effect, None, batch=batch, max_pairs=2 * batch, sequential=sequential)
    if plan.mode != "ab" or h.scenario is None:
        # A check's run per side is one batch; its statistic's samples (3 pairs a run, say) are
        # what the looks count, so the design is two looks of 3.
        return plan_sample(h.metric, h.min_effect, None, batch=3, max_pairs=6, sequential=sequential)
    max_pairs = max(batch, int(opts.get("max_pairs") or 4 * batch))
    base = next((e for e in history if e.role == "baseline" and e.feedback is not None), None)
    windows = noise_from_windows(side_values([base.feedback], h.metric, h.scenario)) if base and base.feedback else None
    groups = [paired_log_ratios(e, h.metric, h.scenario) for e in history
              if e.id != exp.id and e.role in ("experiment", "confirm") and e.finished]
    pairs_noise = estimate_noise(windows, noise_from_pairs(groups))
    return plan_sample(h.metric, h.min_effect, pairs_noise, batch=batch, max_pairs=max_pairs, sequential=sequential,
                       process_noise=tau_for(noise, h.metric)[0])


def why_undecided(workspace: Workspace, exp: Experiment, held: dict[str, GateResult]) -> str | None:
    """Why another batch could decide what this look left open (None: nothing to settle)."""
    v = exp.verdict
    if v is None or not v.served:
        return None
    if v.outcome == "inconclusive" and v.low is not None:
        return f"the hypothesis is undecided ({v.message})"
    guards = undecided_guards(workspace, v, held)
    if guards:
        return "the hypothesis is supported but " + ", ".join(f"guard {g.name} is undecided" for g in guards)
    return None


def judge_in_rounds(workspace: Workspace, executor: Executor, exp: Experiment, plan: Plan, best: Experiment, ex: Execution,
                    held: dict[str, GateResult], sp: SamplePlan, *, take: Callable[[], None],
                    say: Callable[[str], None], on_event: OnEvent | None = None,
                    noise: ProcessNoise | None = None) -> int:
    """Judge ``exp`` at each look of ``sp``'s design, running the next batch while undecided.

    ``take`` copies what ``ex`` holds onto the experiment after a batch; ``say`` reports a
    line; ``noise``: the process term, over as many restarts as batches so far.  Returns the
    number of looks taken."""
    design = sp.design
    look = 1
    while True:
        exp.verdict = judge(workspace, exp, ex, plan, held, confidence=design.confidence,
                            noise=serving_noise(plan, noise, look))
        why = why_undecided(workspace, exp, held)
        if why is None or look >= design.looks:
            break
        say(f"{plan.probe.name}/{plan.probe.tier.value}: look {look} of {design.looks} undecided, one more batch: {why}")
        if not run_extra_batch(executor, exp, plan, best, ex, on_event):
            break
        take()
        look += 1
    if design.looks > 1 and exp.verdict.interval:
        exp.verdict.interval = f"{exp.verdict.interval}; look {look} of {design.looks} (Pocock)"
    if exp.sample_plan is not None:
        exp.sample_plan["looks_taken"] = exp.sample_plan.get("looks_taken", 0) + look
    return look


def by_scenario(fb: Feedback | None, keys: list[str], check: str | None = None) -> dict[str, list[Feedback]]:
    """A side's recorded Feedback (pooled over scenarios) split back into one per scenario, or
    under the check's name, as an execution holds them."""
    if fb is None:
        return {}
    if check is not None:
        return {check: [fb]}
    return {k: [fb.model_copy(update={"measurements": [m for m in fb.measurements if m.tags.get("scenario") == k]})]
            for k in keys}


def execution_of(exp: Experiment, plan: Plan) -> Execution:
    """What ``exp`` measured, from its record, as an execution more batches can pool into."""
    check = plan.check if plan.mode == "pair" else None
    checks = {k: fb for k, fb in exp.checks.items() if k != check}
    return Execution(status="done", candidate=by_scenario(exp.feedback if check is None else exp.checks.get(check),
                                                         plan.scenarios, check),
                     baseline=by_scenario(exp.baseline_feedback, plan.scenarios, check), checks=checks,
                     wall_s=exp.cost.wall_s, e2e_runs=exp.cost.e2e_runs, probe_runs=exp.cost.probe_runs,
                     launches=exp.cost.launches)


def most_promising_open(history: list[Experiment], best: Experiment) -> Experiment | None:
    """The open experiment on ``best`` with the estimate furthest on its predicted side, not yet
    reopened in this run."""
    cands = [e for e in history if e.open and e.parent == best.id and not (e.sample_plan or {}).get("reopened")]

    def promise(e: Experiment) -> float:
        effect = e.verdict.effect if e.verdict and e.verdict.effect else 1.0
        return effect if e.hypothesis.direction == "higher" else 1.0 / effect

    return max(cands, key=promise, default=None)


def reopen(workspace: Workspace, executor: Executor, exp: Experiment, plan: Plan, best: Experiment,
           held: dict[str, GateResult], *, take: Callable[[Execution], None], say: Callable[[str], None],
           on_event: OnEvent | None = None, noise: ProcessNoise | None = None) -> bool:
    """One more batch for an open experiment (inconclusive, promising), pooled with what it
    measured; judged at the level of a design with one look more than it has taken, so the
    extra look is paid for in the interval.  False when the batch could not run."""
    taken = int((exp.sample_plan or {}).get("looks_taken") or 1)
    batch = int((exp.sample_plan or {}).get("batch") or 3)
    design = SequentialDesign(looks=taken + 1, batch=batch)
    ex = execution_of(exp, plan)
    say(f"{exp.id} is open ({exp.verdict.message if exp.verdict else 'undecided'}): one more batch, look {taken + 1} "
        f"({design.confidence:.1%} interval)")
    if not run_extra_batch(executor, exp, plan, best, ex, on_event):
        return False
    take(ex)
    exp.verdict = judge(workspace, exp, ex, plan, held, confidence=design.confidence,
                        noise=serving_noise(plan, noise, taken + 1))
    if exp.verdict.interval:
        exp.verdict.interval = f"{exp.verdict.interval}; look {taken + 1} of {taken + 1} (reopened)"
    exp.sample_plan = {**(exp.sample_plan or {}), "looks_taken": taken + 1, "reopened": True}
    return True


__all__ = ["by_scenario", "execution_of", "judge_in_rounds", "most_promising_open", "paired_log_ratios", "reopen",
           "sample_plan", "serving_noise",
           "why_undecided"]
