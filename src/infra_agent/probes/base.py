"""The probe interface and its registry.

A probe is ``run(config, ctx) -> Feedback`` with:

- a typed config: a pydantic model (``Probe.Config``, extra keys forbidden).  A YAML
  step or an LLM tool call is checked with :meth:`Probe.parse_config`, which raises
  ``ConfigError`` naming the file, the field, what was expected and what came;
- a tier that may depend on the config (:meth:`Probe.tier`): the kernel probe is
  ``check`` for correctness and ``micro`` when it times kernels;
- a scope: the components (see :mod:`infra_agent.vocabulary`) and locality keys it
  can speak to, which the planner uses to pick the cheapest probe for a hypothesis.

**The error contract.**  A bad config raises ``ConfigError`` from ``parse_config``,
before anything runs.  Once a probe runs, it never raises for a failure of the
system under test or of the measurement: it returns ``Feedback(ok=False, error=...)``
with whatever it measured before the failure.  :meth:`Probe.execute` enforces the
second half for every probe, so a caller (the executor, the demo, the MCP server)
handles one shape of failure.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from infra_agent.errors import ConfigError, InfraAgentError
from infra_agent.feedback import Feedback, Location, Tier
from infra_agent.vocabulary import FindingKind, covers


class ProbeConfig(BaseModel):
    """Base of every probe's typed config: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ProbeContext:
    """Where a probe may write artifacts, which workspace it runs for, and on what.

    ``target``: a running target (``infra_agent.target.RunningTarget``) the caller owns.
    When set, a probe that needs a server measures that one instead of launching its
    own, so the caller (the executor) can keep two servers up for an interleaved A B A B
    comparison, with the dead-server watchdog of each target kept.

    ``candidate_root``: the tree that holds the code under test, when it is not the one
    the probe runs in (the working directory, then the pristine tree).  The kernel probe
    judges from the working directory and runs only the kernels from this tree, in a
    worker process of their own.

    ``prompt_set``: the prompt set of the first serving window this run sends; its later
    windows take the next ones (``serving/prompt_sets.py``).  The executor gives both
    sides of an A/B pair the same one and every other window a new one, so no prompt
    repeats across an experiment's windows.  None: the run numbers its windows from 0.
    """

    workdir: Path
    workspace: Any = None  # infra_agent.workspace.Workspace, when a workspace drives the run
    knobs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    target: Any = None
    candidate_root: Path | None = None
    prompt_set: int | None = None


class Probe(ABC):
    """A measurement the agent can ask for (see the module docstring)."""

    name: ClassVar[str]
    #: The cheapest tier this probe runs at; ``tier(config)`` is the tier of one run.
    base_tier: ClassVar[Tier]
    Config: ClassVar[type[ProbeConfig]] = ProbeConfig
    #: Components this probe can measure (vocabulary names; a name covers its children).
    components: ClassVar[tuple[str, ...]] = ()
    #: Location keys it can resolve beyond components (``kernel``, ``variant``, ``thread`` ...).
    locality: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def tier(cls, config: ProbeConfig | None = None) -> Tier:
        """The tier of a run with ``config`` (the base tier when the config does not change it)."""
        return cls.base_tier

    @property
    def scope(self) -> list[str]:
        return [*self.components, *self.locality]

    @classmethod
    def measures(cls, metric: str) -> bool:
        """Whether a run of this probe reports ``metric`` (a measurement name or a ``meta`` count)."""
        return False

    @classmethod
    def covers(cls, location: Location) -> bool:
        """Whether this probe can answer a question about ``location``.

        Every locality key set on the location must be one this probe resolves, and
        its component (if any) must sit under one of the probe's components.
        """
        keys = {k for k in ("kernel", "variant", "precision", "thread", "span") if getattr(location, k)}
        if not keys <= set(cls.locality):
            return False
        if location.component is None:
            return True
        return any(covers(c, location.component) for c in cls.components)

    @classmethod
    def parse_config(cls, raw: Mapping[str, Any] | ProbeConfig | None, where: str = "<probe config>",
                     text: str = "", prefix: tuple[str | int, ...] = ()) -> ProbeConfig:
        """Validate ``raw`` against ``Config``; ``ConfigError`` names where and what."""
        if isinstance(raw, cls.Config):
            return raw
        if isinstance(raw, ProbeConfig):
            raw = raw.model_dump()
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(where, ".".join(map(str, prefix)) or None, f"a mapping of {cls.name} probe options", raw)
        try:
            return cls.Config.model_validate(dict(raw or {}))
        except ValidationError as exc:
            from infra_agent.workspace.loader import translate_validation_error

            raise translate_validation_error(exc, where, text, root=cls.Config, prefix=prefix) from None

    @abstractmethod
    def run(self, config: Any, ctx: ProbeContext) -> Feedback:
        """Measure; return ``ok=False`` Feedback (never raise) when the target or the run fails."""

    def execute(self, config: Mapping[str, Any] | ProbeConfig | None, ctx: ProbeContext) -> Feedback:
        """Validate, run, and hold the error contract: config errors raise, run errors return."""
        cfg = self.parse_config(config)
        try:
            fb = self.run(cfg, ctx)
        except InfraAgentError as exc:
            return self.failed(cfg, str(exc))
        return fb

    def failed(self, config: ProbeConfig | None, error: str, kind: str = FindingKind.PROBE_ERROR) -> Feedback:
        from infra_agent.feedback import Finding

        return Feedback(probe=self.name, tier=self.tier(config), scope=self.scope, ok=False, error=error,
                        findings=[Finding(kind=kind, severity="error", message=error.splitlines()[0] if error else kind)])


# short name -> "module:attr"; filled by the modules that define probes.
_REGISTRY: dict[str, str] = {
    "serving": "infra_agent.probes.serving:ServingProbe",
    "kernel": "infra_agent.probes.kernel:KernelProbe",
    "command": "infra_agent.probes.command:CommandProbe",
    "timeline": "infra_agent.probes.timeline:TimelineProbe",
    "quality": "infra_agent.probes.quality:QualityProbe",
}


def register_probe(short_name: str, target: str) -> None:
    _REGISTRY[short_name] = target


def registered_probes() -> dict[str, str]:
    return dict(_REGISTRY)


def get_probe(name: str) -> type[Probe]:
    """Resolve a short name or a ``module:Class`` / ``module.Class`` path to a probe class."""
    target = _REGISTRY.get(name, name)
    if ":" in target:
        module_name, attr = target.split(":", 1)
    elif "." in target:
        module_name, attr = target.rsplit(".", 1)
    else:
        raise ConfigError(None, "probe", f"one of {sorted(_REGISTRY)} or a dotted path", name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        # The kernel lab needs torch, which a base install (URL benchmarks) leaves out.
        extra = {"torch": "kernels", "triton": "gpu"}.get((exc.name or "").split(".")[0])
        hint = f"; pip install 'infra-agent[{extra}]'" if extra else ""
        raise ConfigError(None, "probe", f"an importable module for probe {name!r}{hint}", f"{module_name} ({exc})") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Probe)):
        raise ConfigError(None, "probe", f"a Probe subclass at {target}", cls)
    return cls
