"""The typed form of ``infra-agent.yaml``: target, knobs, scenarios, criteria.

Every model forbids unknown keys.  Checks that need a field's neighbours (a
placeholder must be a declared knob, a criterion must name a scenario) raise
``DomainError`` with the sub-path, so the loader can report the exact field.
Load files with :func:`infra_agent.workspace.load_workspace`, which turns every
problem into a ``ConfigError`` naming file, field, expected and got.

This module holds :class:`Workspace`, the whole file, and those cross-field checks.
The parts live one concept a module: targets in ``targets``, scenarios and their
datasets in ``scenario``, criteria and metric names in ``criteria``, checks in
``checks``.  They are re-exported here, so ``infra_agent.workspace.models`` stays
the one place to import any of them from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pydantic import Field, PrivateAttr, model_validator

from infra_agent.errors import ConfigError
from infra_agent.workspace import template
from infra_agent.workspace._base import _Strict
from infra_agent.workspace.checks import CheckSpec, _strings
from infra_agent.workspace.constraints import (
    SYNTAX,
    Constraint,
    ConstraintSyntaxError,
    parse_constraint,
)
from infra_agent.workspace.criteria import (
    METRIC_FORMS,
    Criterion,
    check_metric_direction,
    known_metric,
    metric_direction,
    metric_suggestions,
)
from infra_agent.workspace.knobs import MISSING, DomainError, Knob, KnobValue
from infra_agent.workspace.machine import Machine, MachineLimits, machine_limits
from infra_agent.workspace.scenario import (
    Dataset,
    JsonlDataset,
    RandomDataset,
    RandomMMDataset,
    Scenario,
    SharedPrefixDataset,
    Slo,
)
from infra_agent.workspace.targets import EndpointTargetSpec, ServerTargetSpec, Target

__all__ = [
    "DEFAULT_PROTECTED",
    "METRIC_FORMS",
    "RESERVED_PLACEHOLDERS",
    "CheckSpec",
    "Constraint",
    "Criterion",
    "Dataset",
    "EndpointTargetSpec",
    "JsonlDataset",
    "Machine",
    "RandomDataset",
    "RandomMMDataset",
    "Scenario",
    "ServerTargetSpec",
    "SharedPrefixDataset",
    "Slo",
    "Target",
    "Workspace",
    "check_metric_direction",
    "known_metric",
    "metric_direction",
    "metric_suggestions",
]

RESERVED_PLACEHOLDERS = frozenset({"port"})


# Paths a change may never touch, whatever the workspace adds: the tests, the
# criteria and the harness that measure it.  This is the guard against an agent that
# "improves" a number by editing what measures it.
DEFAULT_PROTECTED: tuple[str, ...] = (
    "infra-agent.yaml", "infra-agent.yml", ".infra-agent/**", ".git/**",
    "tests/**", "test/**", "**/test_*.py", "**/*_test.py", "**/conftest.py",
    "bench/**", "benchmarks/**", "**/spec.py",
)


def _check_criterion(ws: Workspace, i: int, crit: Criterion) -> None:
    """A criterion judged on a check's Feedback: the check exists, and the gate is absolute."""
    checks = [c.name for c in ws.checks]
    if crit.check is None:
        raise DomainError(("criteria", i, "check"), f"the name of the workspace check that measures {crit.metric!r} "
                          f"(a quality probe check; checks: {', '.join(checks) or 'none declared'})", MISSING)
    if crit.check not in checks:
        raise DomainError(("criteria", i, "check"), f"one of the workspace checks {checks}", crit.check)
    if crit.scenario is not None:
        raise DomainError(("criteria", i, "scenario"), "no scenario on a criterion judged on a check", crit.scenario)
    if crit.ratio is not None:
        raise DomainError(("criteria", i, "ratio"), "an absolute `value` (a check criterion is judged on the candidate's "
                          "check alone; the quality probe already compares against its baseline server)", crit.ratio)


def _parse_constraints(ws: Workspace) -> list[Constraint]:
    """``constraints:`` parsed; each names declared numeric knobs, and the defaults satisfy it."""
    numeric = sorted(k for k, knob in ws.knobs.items() if knob.type in ("int", "float"))
    defaults = {k: knob.default for k, knob in ws.knobs.items() if knob.default is not None}
    out = []
    for i, text in enumerate(ws.constraints):
        try:
            c = parse_constraint(text)
        except ConstraintSyntaxError as exc:
            raise DomainError(("constraints", i), f"{SYNTAX}; {exc}", text) from None
        for name in c.knobs:
            if name not in numeric:
                raise DomainError(("constraints", i), f"knob names among the declared int and float knobs "
                                  f"({', '.join(numeric) or 'none'})", name)
        if not c.holds(defaults):
            raise DomainError(("constraints", i), f"knob defaults that satisfy {c.text!r}", c.broken(defaults))
        out.append(c)
    return out


# ---------------------------------------------------------------- workspace


class Workspace(_Strict):
    """A loaded ``infra-agent.yaml``; ``root`` is the folder that holds it."""

    name: str | None = None
    target: Target
    knobs: dict[str, Knob] = Field(default_factory=dict)
    scenarios: dict[str, Scenario] = Field(default_factory=dict)
    criteria: list[Criterion] = Field(default_factory=list)
    checks: list[CheckSpec] = Field(default_factory=list)
    # Glob patterns (relative to the workspace root) a change may not touch, added to
    # DEFAULT_PROTECTED.
    protected: list[str] = Field(default_factory=list)
    # The search space across knobs (docs/workspace.md, "The search space"): relations every
    # configuration must satisfy, and the machine the target runs on when it is not this one.
    constraints: list[str] = Field(default_factory=list)
    machine: Machine | None = None

    _root: Path = PrivateAttr(default_factory=Path.cwd)
    _source: Path | None = PrivateAttr(default=None)
    _constraints: list[Constraint] = PrivateAttr(default_factory=list)
    _limits: MachineLimits | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _cross_checks(self) -> Workspace:
        for knob_name in self.knobs:
            if not knob_name.isidentifier() or knob_name in RESERVED_PLACEHOLDERS:
                raise DomainError(("knobs", knob_name), "a knob name that is a Python identifier and not 'port'", knob_name)
        if isinstance(self.target, ServerTargetSpec):
            known = set(self.knobs) | RESERVED_PLACEHOLDERS
            for subpath, text in self.target.templates():
                try:
                    names = template.placeholders(text)
                except ValueError as exc:
                    raise DomainError(("target", *subpath), "a template with {name} placeholders ({{ for a literal brace})", str(exc)) from None
                for name in names:
                    if name not in known:
                        raise DomainError(("target", *subpath), f"placeholders among {{port}} and the declared knobs ({', '.join(sorted(self.knobs)) or 'none'})", "{" + name + "}")
        names = [c.name for c in self.checks]
        for i, check in enumerate(self.checks):
            if names.count(check.name) > 1:
                raise DomainError(("checks", i, "name"), "a check name used once", check.name)
            for sub, text in _strings(check.config):
                try:
                    used = template.placeholders(text)
                except ValueError as exc:
                    raise DomainError(("checks", i, "config", *sub), "a template with {knob} placeholders", str(exc)) from None
                for name in used:
                    if name not in self.knobs:
                        raise DomainError(("checks", i, "config", *sub), f"placeholders among the declared knobs ({', '.join(sorted(self.knobs)) or 'none'})", "{" + name + "}")
        for i, crit in enumerate(self.criteria):
            if crit.check is not None or check_metric_direction(crit.metric) is not None:
                _check_criterion(self, i, crit)
                continue
            if crit.scenario is None:
                if len(self.scenarios) != 1:
                    raise DomainError(("criteria", i, "scenario"), f"a scenario name (one of {sorted(self.scenarios)})", MISSING)
                crit.scenario = next(iter(self.scenarios))
            elif crit.scenario not in self.scenarios:
                raise DomainError(("criteria", i, "scenario"), f"one of the scenarios {sorted(self.scenarios)}", crit.scenario)
        self._constraints = _parse_constraints(self)
        return self

    @property
    def parsed_constraints(self) -> list[Constraint]:
        """``constraints`` as parsed at load, in file order."""
        return list(self._constraints)

    def broken_constraints(self, values: Mapping[str, object]) -> list[tuple[int, Constraint]]:
        """The constraints (with their index in the file) that ``values`` break."""
        return [(i, c) for i, c in enumerate(self._constraints) if not c.holds(values)]

    def machine_limits(self) -> MachineLimits:
        """The cores and memory the target may use: ``machine:``, else this machine's (read once)."""
        if self._limits is None:
            self._limits = machine_limits(self.machine)
        return self._limits

    @property
    def root(self) -> Path:
        return self._root

    @property
    def source(self) -> Path | None:
        """The ``infra-agent.yaml`` this was loaded from (None if built in code)."""
        return self._source

    def bind(self, root: Path, source: Path | None) -> Workspace:
        """Record where this workspace lives (the loader calls this)."""
        self._root = root
        self._source = source
        return self

    def scenario(self, name: str) -> Scenario:
        if name not in self.scenarios:
            raise ConfigError(self._file(), "scenarios", f"one of {sorted(self.scenarios)}", name)
        return self.scenarios[name]

    def resolve_knobs(self, overrides: Mapping[str, object] | None = None) -> dict[str, KnobValue]:
        """Defaults overlaid with ``overrides``; text values (``--set``) are parsed by type.

        Knobs without a default that are not overridden are left out.
        """
        values: dict[str, KnobValue] = {k: knob.default for k, knob in self.knobs.items() if knob.default is not None}
        for name, raw in (overrides or {}).items():
            knob = self.knobs.get(name)
            if knob is None:
                known = ", ".join(sorted(self.knobs)) or "none declared"
                raise ConfigError(self._file(), "knobs", f"a declared knob ({known})", name)
            try:
                values[name] = knob.parse(raw) if isinstance(raw, str) else knob.check(raw)
            except DomainError as exc:
                raise ConfigError(self._file(), f"knobs.{name}", exc.expected, raw) from None
        # A knob the launch command needs but that has no value would only fail at
        # launch time; say so now, where `validate` and `bench --set` can fix it.
        if isinstance(self.target, ServerTargetSpec):
            for subpath, name in self.target.missing_values({*values, *RESERVED_PLACEHOLDERS}):
                raise ConfigError(self._file(), f"knobs.{name}",
                                  f"a value for {{{name}}} in target.{'.'.join(map(str, subpath))} "
                                  f"(the knob has no default: pass --set {name}=...)", None)
        return values

    def _file(self) -> str:
        return str(self._source) if self._source else "<workspace>"

    @property
    def protected_patterns(self) -> list[str]:
        # The files this workspace file references (datasets, specs, prompt sets) are part of
        # what the criteria measure with: as protected as the workspace file itself.
        from infra_agent.workspace.references import referenced_files

        return [*DEFAULT_PROTECTED, *self.protected, *referenced_files(self)]

    def check(self, name: str) -> CheckSpec:
        for c in self.checks:
            if c.name == name:
                return c
        raise ConfigError(self._file(), "checks", f"one of {[c.name for c in self.checks]}", name)
