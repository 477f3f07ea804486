"""The probe interface and its registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from infra_agent.errors import ConfigError
from infra_agent.feedback import Feedback, Tier


@dataclass
class ProbeContext:
    """Where a probe may write artifacts and which workspace it runs for."""

    workdir: Path
    workspace: Any = None  # infra_agent.workspace.Workspace, when a workspace drives the run
    knobs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


class Probe(ABC):
    """A measurement the agent can ask for.

    ``tier`` orders probes by cost; ``scope`` lists what the probe can speak to
    (components, knobs, kernels, threads) so the planner can pick the cheapest one
    that covers a hypothesis.
    """

    name: ClassVar[str]
    tier: ClassVar[Tier]

    @property
    def scope(self) -> list[str]:
        return []

    @abstractmethod
    def run(self, config: dict[str, Any], ctx: ProbeContext) -> Feedback: ...


# short name -> "module:attr"; filled by the modules that define probes.
_REGISTRY: dict[str, str] = {
    "serving": "infra_agent.bench.probe:ServingProbe",
    "kernel": "infra_agent.kernels.probe:KernelProbe",
}


def register_probe(short_name: str, target: str) -> None:
    _REGISTRY[short_name] = target


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
        raise ConfigError(None, "probe", f"an importable module for probe {name!r}", f"{module_name} ({exc})") from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Probe)):
        raise ConfigError(None, "probe", f"a Probe subclass at {target}", cls)
    return cls
