"""How a run ends: why the loop stopped (a value), and the conclusion derived from the final gate table.

The loop stops for one reason (:class:`StopReason`).  What the run *concludes* is not
that reason but the final gate table: the confirmation's, where one ran (the best
against the baseline, side by side), else the accepted path's.  The run's status, its
message, the CLI's exit code, ``--json``, ``ls``, the MCP tools and the report's headline
all come from :func:`conclude`, so none of them can say "every gate passes" while the
table it reports says otherwise:

- "every gate passes" only when every gate in that table passes (or is a guard that
  holds by definition);
- otherwise the message names each gate that does not, with its outcome and interval;
- when nothing was accepted, the message says so honestly (:func:`no_gain`): the best
  configuration tried, its ratio to the baseline with the interval, how many were tried,
  and the smallest effect the noise let the run detect;
- a confirmation that did not confirm leaves the run ``not_confirmed``, says what failed
  against the baseline, that the accepted changes stay on the run's branch, and what to do
  next (``resume`` tops up the confirmation).

Exit codes (``infra-agent run`` / ``resume``): 0 when every gate in the final table
passes, 3 when the run ended with a gate that does not (failed, undecided, or not
confirmed), 1 when the run itself failed, 2 for a mistake in the command, 130 when
interrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from infra_agent.records import (
    COUNT_METRICS,
    EXACT_COUNT,
    Experiment,
    GateResult,
    RunRecord,
    RunStatus,
)

PASSING = frozenset({"pass", "skipped"})
GATES_NOT_MET_EXIT = 3


class StopKind(str, Enum):
    GATES_PASS = "gates_pass"  # every gate of the accepted path passes
    GUARDS_ONLY = "guards_only"  # only relative guards, holding on the baseline by definition
    BUDGET_RUNS = "budget_runs"
    BUDGET_TIME = "budget_time"
    NOTHING_LEFT = "nothing_left"  # the proposer has nothing more to try
    PROPOSER_FAILED = "proposer_failed"
    SCREENED_OUT = "screened_out"  # proposals in a row that could not run


@dataclass(frozen=True)
class StopReason:
    kind: StopKind
    detail: str  # one sentence, as the progress line prints it

    @property
    def budget(self) -> bool:
        return self.kind in (StopKind.BUDGET_RUNS, StopKind.BUDGET_TIME)

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class Conclusion:
    status: RunStatus
    message: str
    not_passing: tuple[GateResult, ...]

    @property
    def every_gate_passes(self) -> bool:
        return not self.not_passing


def describe_gate(g: GateResult) -> str:
    """``name fails (0.87 [0.82, 0.92])`` / ``name is inconclusive (1.12 [0.98, 1.24]; ~40 more samples)``."""
    verb = {"fail": "fails", "inconclusive": "is inconclusive", "error": "could not be measured"}.get(g.outcome,
                                                                                                    f"is {g.outcome}")
    parts = []
    if g.value is not None and g.interval == EXACT_COUNT:
        parts.append(f"{g.value:.3g}, {EXACT_COUNT}")  # not a zero-width interval: a count is exact
    elif g.value is not None:
        parts.append(f"{g.value:.3g}" + (f" [{g.low:.3g}, {g.high:.3g}]" if g.low is not None and g.high is not None else ""))
    if g.outcome == "inconclusive" and g.more_samples:
        parts.append(f"~{g.more_samples} more samples")
    if not parts and g.message:
        parts.append(g.message.splitlines()[0][:160])
    return f"{g.name} {verb}" + (f" ({'; '.join(parts)})" if parts else "")


def not_passing(gates: Sequence[GateResult]) -> tuple[GateResult, ...]:
    return tuple(g for g in gates if g.kind != "hypothesis" and g.outcome not in PASSING)


def no_gain(history: Sequence[Experiment], run: RunRecord) -> str | None:
    """The honest stop, when nothing was accepted: how close the best configuration tried came
    to the baseline (its paired ratio and interval), what was tried, and the smallest effect the
    noise let the run detect.  None when something was accepted or nothing was measured."""
    if run.best not in (None, run.baseline):
        return None
    tried = [e for e in history if e.role == "experiment" and e.status == "done" and e.verdict is not None
             and e.verdict.effect is not None and e.verdict.low is not None and e.verdict.high is not None
             and e.hypothesis.metric not in COUNT_METRICS]
    if not tried:
        return None

    def gain(e: Experiment) -> float:
        assert e.verdict is not None and e.verdict.effect is not None
        return e.verdict.effect if e.hypothesis.direction == "higher" else 1 / e.verdict.effect

    best = max(tried, key=gain)
    v = best.verdict
    assert v is not None and v.effect is not None and v.low is not None and v.high is not None
    h = best.hypothesis
    change = ", ".join(f"{k}={val}" for k, val in best.change.knobs.items()) + (" + code" if best.change.diff else "")
    where = f"{h.metric}" + (f" @{h.scenario}" if h.scenario else "")
    line = h.ratio_threshold()
    past = v.effect >= line if h.direction == "higher" else v.effect <= line
    # An estimate past the line with an interval across it is undecided, not short of the effect:
    # "no gain found" would say the layer-granular 1.63x [1.04, 2.54] against a 10% line was none.
    verdict = (f"no gain established: the best configuration tried, {best.id} ({change or 'a change'}), is "
               f"{v.effect:.3f}x the baseline on {where} [{v.low:.3f}, {v.high:.3f}], an interval across its "
               f"{h.min_effect * 100:.3g}% minimum effect (undecided, not refuted)"
               if v.outcome == "inconclusive" and past else
               f"no gain found: the best configuration tried, {best.id} ({change or 'a change'}), is {v.effect:.3f}x "
               f"the baseline on {where} [{v.low:.3f}, {v.high:.3f}], short of its {h.min_effect * 100:.3g}% "
               "minimum effect")
    text = f"{verdict}; {len(tried)} configuration(s) tried"
    plans = [e.sample_plan for e in tried if e.sample_plan and e.sample_plan.get("detectable") is not None]
    if plans:
        last = plans[-1]
        noise = last.get("noise") or {}
        sd = f" (noise {noise['sd']:.1%} per pair)" if noise.get("sd") is not None else ""
        text += (f"; at this noise{sd} {last.get('max_pairs')} pairs detect changes of {last['detectable']:.1%} "
                 "or more at 90% power")
    return text


def conclude(stop: StopReason, final: Sequence[GateResult], confirmation: Experiment | None, run: RunRecord,
             history: Sequence[Experiment] = ()) -> Conclusion:
    """The run's status and message from why it stopped and its final gate table.

    ``confirmation``: the confirmation of the best against the baseline, when one ran;
    ``history``: the run's experiments, for the honest stop when nothing was accepted."""
    missing = not_passing(final)
    listed = "; ".join(describe_gate(g) for g in missing)
    honest = no_gain(history, run) if stop.kind not in (StopKind.GATES_PASS, StopKind.GUARDS_ONLY) else None
    if honest is not None:
        stop = StopReason(stop.kind, f"{stop.detail}; {honest}")
    if stop.kind is StopKind.PROPOSER_FAILED:
        return Conclusion("error", f"{stop.detail}" + (f"; {listed}" if listed else ""), missing)
    confirmed = confirmation is not None and confirmation.verdict is not None \
        and confirmation.verdict.outcome == "confirmed"
    if confirmation is not None and not confirmed:
        branch = f" on branch {run.branch}" if run.branch else ""
        what = listed or (confirmation.error or "the confirmation did not finish")
        message = (f"not confirmed: against the baseline, side by side in {confirmation.id}, {what}; the accepted "
                   f"changes stay{branch} (best {run.best}); next: `infra-agent resume {run.id}` tops up the "
                   f"confirmation with more pairs, or start a new run to search on")
        return Conclusion("not_confirmed", message, missing)
    status: RunStatus = "budget" if stop.budget else "done"
    if not missing:
        if stop.kind in (StopKind.GATES_PASS, StopKind.GUARDS_ONLY):
            return Conclusion(status, stop.detail, missing)
        return Conclusion(status, f"{stop.detail}; every gate passes", missing)
    if stop.kind is StopKind.GATES_PASS:
        # The accepted path's table passed, but not the final one (no confirmation ran to say so).
        return Conclusion(status, f"not every gate passes: {listed}", missing)
    return Conclusion(status, f"{stop.detail}; not every gate passes: {listed}", missing)


def exit_code(run: RunRecord) -> int:
    """The CLI's exit status for a finished run (see the module docstring)."""
    if run.status == "interrupted":
        return 130
    if run.status in ("error", "running"):
        return 1
    if run.status == "not_confirmed" or not_passing(run.gates_after):
        return GATES_NOT_MET_EXIT
    return 0


__all__ = ["GATES_NOT_MET_EXIT", "Conclusion", "StopKind", "StopReason", "conclude", "describe_gate", "exit_code",
           "no_gain", "not_passing"]
