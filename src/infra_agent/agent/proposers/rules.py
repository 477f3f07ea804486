"""The ``rules`` proposer: a declarative playbook read against the Feedback.

A rule says: when a finding of kind K appears at location L, propose change C with
hypothesis H.  It is deterministic: the same feedback gives the same step.  Rules are
tried in severity order of their findings (errors first), then in playbook order; a
change already tried in this run is skipped.  A rule with no ``when`` fires once,
unconditionally (a fixed step, for tests and scripted runs).

```yaml
rules:
  - name: raise-batch-cap
    when: {kind: queue_dominates_ttft, component: engine.scheduler}
    change:
      knob: [max_running, max_num_seqs]   # the first the workspace declares
      multiply: 4                         # or: set: VALUE, or: add: N  (clamped to the domain)
    hypothesis:
      statement: "Requests queue for a batch slot: {knob} {old} -> {new} cuts the queue and raises throughput"
      metric: output_throughput
      direction: higher
      min_effect: 0.2
```

``{knob}``, ``{old}``, ``{new}`` and ``{finding.<evidence key or location field>}``
are filled in the statement; ``scenario`` defaults to the finding's scenario.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra_agent.agent.proposers.base import LoopState
from infra_agent.errors import ConfigError
from infra_agent.feedback import Finding, Location
from infra_agent.records import Change, Experiment, Hypothesis, Step
from infra_agent.vocabulary import FindingKind, covers


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class When(_Strict):
    kind: str
    component: str | None = None  # the finding's component must sit under this one
    kernel: str | None = None
    precision: str | None = None
    severity: Literal["info", "warning", "error"] | None = None

    @model_validator(mode="after")
    def _known_kind(self) -> When:
        if self.kind not in FindingKind.all():
            raise ValueError(f"expected a finding kind among {sorted(FindingKind.all())}, got {self.kind!r}")
        return self


class ChangeRule(_Strict):
    knob: list[str] = Field(min_length=1)
    set: bool | int | float | str | None = None
    multiply: float | None = Field(None, gt=0)
    add: float | None = None

    @model_validator(mode="after")
    def _one_action(self) -> ChangeRule:
        if sum(x is not None for x in (self.set, self.multiply, self.add)) != 1:
            raise ValueError("exactly one of set, multiply, add")
        return self


class HypothesisRule(_Strict):
    statement: str
    metric: str
    direction: Literal["higher", "lower"]
    min_effect: float = Field(0.0, ge=0)
    scenario: str | None = None
    locality: dict[str, str] = Field(default_factory=dict)  # extra Location fields; "{finding.kernel}" allowed


class Rule(_Strict):
    name: str
    when: When | None = None
    change: ChangeRule
    hypothesis: HypothesisRule


class Playbook(_Strict):
    rules: list[Rule]


def load_playbook(path: str | Path | None = None) -> Playbook:
    """A playbook file, or the one shipped with the package."""
    if path is None:
        text, where = resources.files("infra_agent.agent.proposers").joinpath("playbook.yaml").read_text(), "<builtin playbook>"
    else:
        where = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(where, None, "a playbook file (YAML; --playbook)", "no such file") from None
        except IsADirectoryError:
            raise ConfigError(where, None, "a playbook file (YAML; --playbook)", "a directory") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(where, None, "a readable playbook file (YAML, UTF-8)", reason) from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        raise ConfigError(at, None, "valid YAML", "; ".join(x for x in (exc.context, exc.problem) if x) or str(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(where, None, "valid YAML", str(exc).splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ConfigError(where, None, "a mapping with `rules:` (a list of rules)", "an empty file" if data is None else data)
    _check_kinds(data, where, text)
    try:
        return Playbook.model_validate(data)
    except ValidationError as exc:
        from infra_agent.workspace.loader import translate_validation_error

        raise translate_validation_error(exc, where, text, root=Playbook) from None


def _check_kinds(data: dict[str, Any], where: str, text: str) -> None:
    """An unknown finding kind, named at ``rules.N.when.kind`` with its line (the model's check names only ``when``)."""
    rules = data.get("rules")
    for i, rule in enumerate(rules if isinstance(rules, list) else []):
        when = rule.get("when") if isinstance(rule, dict) else None
        kind = when.get("kind") if isinstance(when, dict) else None
        if isinstance(kind, str) and kind not in FindingKind.all():
            at = _position_of(text, kind, i)
            raise ConfigError(f"{where}:{at}" if at else where, f"rules.{i}.when.kind",
                              f"a finding kind, one of {', '.join(sorted(FindingKind.all()))}", kind)


def _position_of(text: str, kind: str, index: int) -> str | None:
    """``line:column`` of the ``kind`` value under the ``index``-th rule, from the YAML's nodes."""
    try:
        root = yaml.compose(text)
        rules = next(v for k, v in root.value if k.value == "rules")
        rule = rules.value[index]
        when = next(v for k, v in rule.value if k.value == "when")
        node = next(v for k, v in when.value if k.value == "kind")
    except (yaml.YAMLError, AttributeError, StopIteration, IndexError, TypeError):
        return None
    return f"{node.start_mark.line + 1}:{node.start_mark.column + 1}" if node.value == kind else None


_SEVERITY = {"error": 0, "warning": 1, "info": 2}


class RulesProposer:
    name = "rules"

    def __init__(self, playbook: Playbook | None = None) -> None:
        self.playbook = playbook or load_playbook()
        self.stopped_reason: str | None = None
        self._fired_unconditional: set[str] = set()

    def observe(self, state: LoopState, experiment: Experiment) -> None:
        return None

    def propose(self, state: LoopState) -> Step | None:
        tried = state.tried()
        findings = sorted(state.findings, key=lambda f: _SEVERITY.get(f.severity, 3))
        for finding in findings:
            for rule in self.playbook.rules:
                if rule.when is not None and _matches(rule.when, finding):
                    step = self._step(rule, state, finding)
                    if step is not None and step.change.key() not in tried:
                        return step
        for rule in self.playbook.rules:
            if rule.when is None and rule.name not in self._fired_unconditional:
                self._fired_unconditional.add(rule.name)
                step = self._step(rule, state, None)
                if step is not None and step.change.key() not in tried:
                    return step
        self.stopped_reason = "no rule of the playbook matches the findings with a change not yet tried"
        return None

    def _step(self, rule: Rule, state: LoopState, finding: Finding | None) -> Step | None:
        ws = state.workspace
        knob = next((k for k in rule.change.knob if k in ws.knobs), None)
        if knob is None:
            return None
        old = state.best.knobs.get(knob, ws.knobs[knob].default)
        new = _apply(rule.change, ws.knobs[knob], old)
        if new is None or new == old:
            return None
        ev: dict[str, Any] = dict(finding.evidence) if finding else {}
        if finding and finding.location:
            ev.update({k: v for k, v in finding.location.model_dump().items() if v is not None})
        fill = _Filler(knob=knob, old=old, new=new, finding=ev)
        loc = {k: fill(v) for k, v in rule.hypothesis.locality.items()}
        locality = Location(**{"component": (ws.knobs[knob].components or [None])[0], "knob": knob, **loc})
        scenario = fill(rule.hypothesis.scenario) if rule.hypothesis.scenario else ev.get("scenario")
        hyp = Hypothesis(statement=fill(rule.hypothesis.statement), metric=rule.hypothesis.metric,
                         direction=rule.hypothesis.direction, min_effect=rule.hypothesis.min_effect,
                         scenario=scenario if scenario in ws.scenarios else None, locality=locality)
        why = f"rule {rule.name}" + (f" on finding {finding.kind} @ {finding.location}" if finding else " (unconditional)")
        return Step(hypothesis=hyp, change=Change(knobs={knob: new}, description=why), rationale=why)


def _matches(when: When, f: Finding) -> bool:
    loc = f.location or Location()
    return (f.kind == when.kind
            and (when.component is None or (loc.component is not None and covers(when.component, loc.component)))
            and (when.kernel is None or loc.kernel == when.kernel)
            and (when.precision is None or loc.precision == when.precision or f.evidence.get("precision") == when.precision)
            and (when.severity is None or f.severity == when.severity))


def _apply(rule: ChangeRule, knob: Any, old: Any) -> Any:
    """The new value, clamped into the knob's domain; None when the rule cannot apply."""
    if rule.set is not None:
        value: Any = rule.set
    elif not isinstance(old, (int, float)) or isinstance(old, bool):
        return None
    else:
        value = old * rule.multiply if rule.multiply is not None else old + (rule.add or 0)
        if knob.type == "int":
            value = round(value)  # a float rounds to an int (half to even)
        lo = knob.min if knob.min is not None else value
        hi = knob.max if knob.max is not None else value
        value = min(max(value, lo), hi)
    try:
        return knob.parse(value) if isinstance(value, str) else knob.check(value)
    except ValueError:
        return None


class _Filler:
    def __init__(self, **values: Any) -> None:
        self.values = values

    def __call__(self, text: str) -> str:
        out = text
        for k, v in self.values.items():
            if k == "finding":
                for fk, fv in v.items():
                    out = out.replace("{finding." + fk + "}", f"{fv:.0%}" if fk.endswith("share") and isinstance(fv, float)
                                      else _short(fv))
            else:
                out = out.replace("{" + k + "}", _short(v))
        return out


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)
