"""The planner: the cheapest probe that can answer a hypothesis, and the gates before it.

- A hypothesis about a kernel, a variant or a precision goes to a kernel check (or a
  kernel benchmark when its metric is a time), never to a deployment.
- A hypothesis about a thread or an execution interval goes to the timeline probe when
  one is registered (tier ``trace``), else to the serving probe, which can only say
  *that* an interval moved.
- An end-to-end claim goes to the serving probe as an interleaved A/B.

Among the probes whose scope covers the hypothesis's locality, the lowest tier wins,
then the lowest cost learned from the ledger (mean wall seconds of past runs of that
probe at that tier).  Before an end-to-end run of a code change, the workspace's
checks run on the candidate (all of them for a diff; for knobs, those whose
components relate to the changed knobs), cheapest first, and the first failure stops
the experiment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Tier
from infra_agent.probes.base import Probe, get_probe, registered_probes
from infra_agent.records import ProbeCall, Step
from infra_agent.vocabulary import related
from infra_agent.workspace.models import CheckSpec, Workspace

# ProbeCall.reason of a probe the proposer named (Step.probe), not one the planner chose: a run
# killed before the start re-runs it (agent/steps.py), a resumed search restores its check objective.
NAMED = "named by the proposer"
_TIME_METRICS = ("median_s", "time_s", "latency", "gflops", "bandwidth")


@dataclass(frozen=True)
class ProbeCost:
    n: int
    mean_s: float


@dataclass
class Plan:
    probe: ProbeCall
    mode: Literal["ab", "pair"]  # ab: interleaved serving runs; pair: the probe once per side
    scenarios: list[str] = field(default_factory=list)
    check: str | None = None  # the workspace check the main probe comes from (mode pair)
    pre_checks: list[str] = field(default_factory=list)
    # The metrics the judge needs from each serving window (criteria and hypothesis).
    result_metrics: list[str] = field(default_factory=list)


def is_timed_pair(plan: Plan) -> bool:
    """A check run on each side that times code (a kernel bench, tier micro), not one that only
    checks it: its two sides are compared as timings, so they run in interleaved rounds."""
    return plan.mode == "pair" and plan.probe.tier == Tier.micro


class Planner:
    def __init__(self, workspace: Workspace, costs: Mapping[tuple[str, str], Any] | None = None,
                 scenarios: list[str] | None = None) -> None:
        self.ws = workspace
        self.costs = dict(costs or {})
        self.scenarios = scenarios  # restrict e2e runs to these (None: what hypothesis and criteria name)

    def learn(self, costs: Mapping[tuple[str, str], Any]) -> None:
        self.costs = dict(costs)

    def cost_text(self, probe: str, tier: Tier) -> str:
        c = self.costs.get((probe, tier.value))
        if c is None or not getattr(c, "n", 0):
            return "no past runs"
        return f"~{c.mean_s:.1f} s measured over {c.n} run(s)"

    def plan(self, step: Step, changed_components: list[str]) -> Plan:
        h = step.hypothesis
        if step.probe is not None:
            return self._forced(step)
        options: list[tuple[int, float, str, Plan]] = []
        for check in self.ws.checks:
            cls = get_probe(check.probe)
            if not cls.measures(h.metric) or not cls.covers(h.locality) or \
                    not self._relevant(check, h.locality.component, changed_components):
                continue
            cfg: dict[str, Any] = dict(check.config)
            if check.probe == "kernel":
                cfg["mode"] = "bench" if any(t in h.metric for t in _TIME_METRICS) else "check"
            tier = cls.tier(cls.parse_config(check.render(self._defaults())) if check.probe != "kernel"
                            else cls.parse_config({**check.render(self._defaults()), "mode": cfg.get("mode", "check")}))
            call = ProbeCall(name=check.probe, config=cfg, tier=tier, check=check.name)
            options.append((tier.rank, self._mean(check.probe, tier), f"check {check.name!r}", Plan(call, "pair", check=check.name)))
        if "timeline" in registered_probes() and (h.locality.thread or h.locality.span):
            tl = get_probe("timeline")
            if tl.measures(h.metric) and tl.covers(h.locality):
                call = ProbeCall(name="timeline", config={}, tier=tl.tier())
                options.append((call.tier.rank, self._mean("timeline", call.tier), "the timeline probe", Plan(call, "ab")))
        serving = get_probe("serving")
        if serving.measures(h.metric) and serving.covers(h.locality):
            call = ProbeCall(name="serving", config={}, tier=serving.tier())
            options.append((call.tier.rank, self._mean("serving", call.tier), "the serving benchmark", Plan(call, "ab")))
        if not options:
            raise InfraAgentError(f"no registered probe covers the hypothesis's locality ({h.locality}) and metric "
                                  f"{h.metric!r}; declare a check for it in the workspace, or name the probe")
        options.sort(key=lambda o: (o[0], o[1]))
        _, _, label, plan = options[0]
        others = [f"{o[3].probe.name}/{o[3].probe.tier.value} ({self.cost_text(o[3].probe.name, o[3].probe.tier)})"
                  for o in options[1:]]
        plan.probe.reason = (f"{label} ({plan.probe.name}/{plan.probe.tier.value}, {self.cost_text(plan.probe.name, plan.probe.tier)}) "
                             f"is the cheapest probe whose scope covers {h.locality or 'the claim'}"
                             + (f"; not {', '.join(others)}" if others else ""))
        self._finish(plan, step, changed_components)
        return plan

    # ------------------------------------------------------------------ helpers

    def _forced(self, step: Step) -> Plan:
        assert step.probe is not None
        if step.probe == "serving":
            cls: type[Probe] = get_probe(step.probe)
            call = ProbeCall(name=step.probe, config=step.probe_config, tier=cls.tier(cls.parse_config(step.probe_config)),
                             reason=NAMED)
            plan = Plan(call, "ab")
        else:
            # Any other probe runs once per side as a workspace check: the check's config, with
            # the proposer's keys (kept as the call's config) over it.  A check is named by its
            # own name or by its probe.
            check = self._check_for(step.probe)
            cls = get_probe(check.probe)
            raw = {**check.render(self._defaults()), **step.probe_config}
            tier = cls.tier(cls.parse_config(raw, where=f"probe config named by the proposer for check {check.name!r}"))
            call = ProbeCall(name=check.probe, config=dict(step.probe_config), tier=tier, reason=NAMED,
                             check=check.name)
            plan = Plan(call, "pair", check=check.name)
        self._finish(plan, step, [])
        return plan

    def _check_for(self, probe: str) -> CheckSpec:
        by_name = [c for c in self.ws.checks if c.name == probe]
        by_probe = [c for c in self.ws.checks if c.probe == probe]
        if by_name or len(by_probe) == 1:
            return (by_name or by_probe)[0]
        names = [c.name for c in self.ws.checks]
        if by_probe:
            raise InfraAgentError(f"probe {probe!r} named by the proposer is used by several workspace checks "
                                  f"({', '.join(c.name for c in by_probe)}); name the check instead")
        raise InfraAgentError(f"probe {probe!r} named by the proposer: only 'serving' or a workspace check can be forced "
                              f"(checks: {', '.join(names) or 'none declared'})")

    def _finish(self, plan: Plan, step: Step, changed_components: list[str]) -> None:
        h = step.hypothesis
        if plan.mode == "ab":
            known = self.scenarios if self.scenarios else sorted(self.ws.scenarios)
            if h.scenario is not None and h.scenario not in known:
                raise InfraAgentError(f"the hypothesis's scenario {h.scenario!r} is not among the "
                                      f"{'run' if self.scenarios else 'workspace'}'s scenarios ({', '.join(known)})")
            names = self.scenarios or sorted({*([h.scenario] if h.scenario else []),
                                              *(c.scenario for c in self.ws.criteria if c.scenario)})
            plan.scenarios = names or sorted(self.ws.scenarios)
            metrics = {c.metric for c in self.ws.criteria} | {h.metric}
            plan.result_metrics = sorted(metrics)
        # Cheap gates first: every check for a code change; related ones for knobs.
        pre = [c for c in self.ws.checks if c.name != plan.check and
               (step.change.diff or any(related(a, b) for a in c.components for b in changed_components))]
        pre.sort(key=lambda c: self._mean(c.probe, get_probe(c.probe).base_tier))
        plan.pre_checks = [c.name for c in pre]

    def _relevant(self, check: CheckSpec, component: str | None, changed: list[str]) -> bool:
        if not check.components:
            return True
        targets = [t for t in (component, *changed) if t]
        return not targets or any(related(c, t) for c in check.components for t in targets)

    def _mean(self, probe: str, tier: Tier) -> float:
        c = self.costs.get((probe, tier.value))
        # Unknown costs sort by tier alone (the tier order is the prior).
        return float(getattr(c, "mean_s", 0.0)) if c is not None else 0.0

    def _defaults(self) -> dict[str, Any]:
        return {k: knob.default for k, knob in self.ws.knobs.items() if knob.default is not None}
