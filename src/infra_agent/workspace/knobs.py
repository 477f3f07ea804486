"""Knobs: launch parameters with a typed domain.

A knob is declared once in ``infra-agent.yaml``; its value comes from the default,
from ``--set name=value`` on the command line, or from a proposer.  Values given as
text are parsed by the knob's type; every value is checked against the domain.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra_agent.errors import ConfigError

KnobValue = bool | int | float | str

# Numeric knobs whose domain spans this ratio (max/min, from a positive min) are searched
# on a log scale unless they declare ``scale``: 1..4096 slots is a question of doubling,
# not of adding 100 at a time.
LOG_RATIO = 64
# What a knob may consume of the machine; the search and screening bound it there.
Resource = Literal["threads", "memory_gib", "memory_mib"]
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class DomainError(ValueError):
    """A value outside its expected domain, raised inside model validation.

    It is a ``ValueError`` so pydantic collects it like any validation error; the
    workspace loader reads ``subpath``/``expected``/``got`` back from it so the
    final ``ConfigError`` names the exact field (e.g. ``knobs.threads.default``)
    instead of the model that raised.
    """

    def __init__(self, subpath: tuple[str | int, ...], expected: str, got: object) -> None:
        self.subpath = subpath
        self.expected = expected
        self.got = got
        super().__init__(f"expected {expected}, got {got!r}")


class _Missing:
    """Stands for an absent value in error messages (prints as ``nothing``)."""

    def __repr__(self) -> str:
        return "nothing"


MISSING: object = _Missing()


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["a=1", "b=x"]`` (repeated ``--set`` options) to ``{"a": "1", "b": "x"}``.

    Values stay text; ``Workspace.resolve_knobs`` parses them by each knob's type.
    """
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError("--set", None, "name=value", item)
        out[name.strip()] = value
    return out


def _fmt(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return repr(value)
    return str(value)


def render_value(value: KnobValue) -> str:
    """How a knob value appears in a launch command (bools as ``true``/``false``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Knob(BaseModel):
    """One knob: its type, domain, default and the components it affects."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["int", "float", "bool", "choice", "str"]
    # int | float (not float) so an int knob's bounds print as ints.
    min: int | float | None = None
    max: int | float | None = None
    choices: list[KnobValue] | None = None
    default: KnobValue | None = None
    # Attribution uses this to pick which knobs to try for a component's finding.
    components: list[str] = Field(default_factory=list)
    help: str = ""
    # The search space (docs/workspace.md, "The search space"): how values spread, the range
    # a user would pick from first, what the knob consumes of the machine, and values that
    # launch the same thing on this target.
    scale: Literal["log", "linear"] | None = None
    typical: list[int | float] | None = None
    resource: Resource | None = None
    per_process: int | None = Field(None, ge=1)  # processes of the launch that take the value each
    aliases: dict[KnobValue, KnobValue] = Field(default_factory=dict)
    # The knob is meant to change what the model answers (a precision, a quantisation, the
    # weights' seed): a change of it is not held to the parent's greedy text (judge/greedy_text.py).
    changes_outputs: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> Knob:
        from infra_agent.vocabulary import check_component

        for i, component in enumerate(self.components):
            problem = check_component(component)
            if problem:
                raise DomainError(("components", i), problem, component)
        numeric = self.type in ("int", "float")
        if not numeric and (self.min is not None or self.max is not None):
            raise DomainError(("min" if self.min is not None else "max",), "min/max only on int or float knobs", self.type)
        if self.min is not None and self.max is not None and self.min > self.max:
            raise DomainError(("max",), f"max >= min ({_fmt(self.min)})", self.max)
        if self.type == "choice":
            if not self.choices:
                raise DomainError(("choices",), "a non-empty list of choices for a choice knob", self.choices)
        elif self.choices is not None:
            raise DomainError(("choices",), "choices only on knobs of type choice", self.type)
        if self.default is not None:
            try:
                self.default = self.check(self.default)
            except DomainError as exc:
                raise DomainError(("default",), exc.expected, exc.got) from None
        self._check_search_space(numeric)
        return self

    def _check_search_space(self, numeric: bool) -> None:
        """``scale``, ``typical``, ``resource``/``per_process`` and ``aliases`` against the domain."""
        if not numeric:
            for key in ("scale", "typical", "resource"):
                if getattr(self, key) is not None:
                    raise DomainError((key,), f"{key} only on int or float knobs", self.type)
        if self.scale == "log" and not (self.min is not None and self.min > 0):
            raise DomainError(("scale",), "a positive min for scale log (or scale linear)", self.min)
        if self.typical is not None:
            self.typical = self._typical(self.typical)
        if self.per_process is not None and self.resource is None:
            raise DomainError(("per_process",), "per_process only with resource (threads, memory_gib or memory_mib)", self.per_process)
        aliases: dict[KnobValue, KnobValue] = {}
        for alias, target in self.aliases.items():
            name = render_value(alias)
            got_key, got_target = self._member(alias), self._member(target)
            if got_key is None:
                raise DomainError(("aliases", name), f"an alias that is a value of the knob ({self.domain()})", alias)
            if got_target is None:
                raise DomainError(("aliases", name), f"a value of the knob ({self.domain()})", target)
            if got_key == got_target and type(got_key) is type(got_target):
                raise DomainError(("aliases", name), "an alias of another value", target)
            aliases[got_key] = got_target
        self.aliases = aliases

    def _typical(self, typical: list[int | float]) -> list[int | float]:
        expected = f"[lo, hi] with min <= lo <= hi <= max ({self.domain()})"
        if len(typical) != 2:
            raise DomainError(("typical",), expected, typical)
        try:
            lo, hi = (self.check(v) for v in typical)
        except DomainError:
            raise DomainError(("typical",), expected, typical) from None
        assert isinstance(lo, (int, float)) and isinstance(hi, (int, float))
        if lo > hi:
            raise DomainError(("typical",), expected, typical)
        return [lo, hi]

    def _member(self, value: Any) -> KnobValue | None:
        """``value`` as a value of the domain (text parsed by type, as ``--set`` is), else None."""
        try:
            return self.check(value)
        except DomainError:
            pass
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            try:
                return self.parse(str(value))
            except DomainError:
                return None
        return None

    @property
    def log_scale(self) -> bool:
        """Whether the search spreads this knob's values on a log scale (``scale``, else the rule)."""
        if self.scale is not None:
            return self.scale == "log"
        return self.min is not None and self.max is not None and self.min > 0 and self.max / self.min >= LOG_RATIO

    @property
    def processes(self) -> int:
        """How many processes of the launch take this knob's value each (``per_process``, default 1)."""
        return self.per_process or 1

    def canonical(self, value: KnobValue) -> KnobValue:
        """The value ``value`` launches as: its alias target, followed to the end (``aliases``)."""
        for _ in range(len(self.aliases)):
            target = next((t for k, t in self.aliases.items() if type(k) is type(value) and k == value), None)
            if target is None:
                break
            value = target
        return value

    def domain(self) -> str:
        """The domain in words, for error messages and the ``validate`` table."""
        if self.type == "choice":
            assert self.choices is not None
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.type == "bool":
            return "bool (true/false)"
        if self.type in ("int", "float"):
            lo, hi = self.min, self.max
            if lo is not None and hi is not None:
                return f"{self.type} in [{_fmt(lo)}, {_fmt(hi)}]"
            if lo is not None:
                return f"{self.type} >= {_fmt(lo)}"
            if hi is not None:
                return f"{self.type} <= {_fmt(hi)}"
        return self.type

    def check(self, value: Any) -> KnobValue:
        """Return ``value`` normalised to the knob's type, or raise ``DomainError``."""
        if self.type == "choice":
            assert self.choices is not None
            for choice in self.choices:
                # bool is an int in Python; keep True from matching a choice of 1.
                if type(choice) is type(value) and choice == value:
                    return choice
            raise DomainError((), self.domain(), value)
        if self.type == "bool":
            if isinstance(value, bool):
                return value
            raise DomainError((), self.domain(), value)
        if self.type == "str":
            if isinstance(value, str):
                return value
            raise DomainError((), self.domain(), value)
        number: int | float
        if self.type == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise DomainError((), self.domain(), value)
            number = value
        else:
            # inf/nan are never a meaningful launch flag, and JSON cannot hold them.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DomainError((), self.domain(), value)
            number = float(value)
        if (self.min is not None and number < self.min) or (self.max is not None and number > self.max):
            raise DomainError((), self.domain(), value)
        return number

    def parse(self, text: str) -> KnobValue:
        """Parse ``--set`` text by the knob's type, then check the domain."""
        value: KnobValue
        stripped = text.strip()
        if self.type == "int":
            try:
                value = int(stripped)
            except ValueError:
                raise DomainError((), self.domain(), text) from None
        elif self.type == "float":
            try:
                value = float(stripped)
            except ValueError:
                raise DomainError((), self.domain(), text) from None
        elif self.type == "bool":
            low = stripped.lower()
            if low not in _TRUE | _FALSE:
                raise DomainError((), self.domain(), text)
            value = low in _TRUE
        elif self.type == "choice":
            assert self.choices is not None
            # Choices may be numbers in YAML; compare their rendered text.
            for choice in self.choices:
                if render_value(choice) == stripped or str(choice) == stripped:
                    return choice
            raise DomainError((), self.domain(), text)
        else:
            value = text
        try:
            return self.check(value)
        except DomainError:
            raise DomainError((), self.domain(), text) from None  # report what the user typed
