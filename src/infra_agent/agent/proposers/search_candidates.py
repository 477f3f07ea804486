"""Which configurations the search may propose, and which it has tried.

A candidate is new when no configuration that launches the same thing was tried (values
compared as the knobs parse them, aliases followed), the change was not tried before, it
breaks none of the workspace's constraints, it asks no more of the machine than it has
(screening's rules, ``agent/screening.py``), and the launch sees it: a knob set to an alias
of the best's value, or to a value no placeholder renders, is set back to the best's value
(:meth:`Candidates.effective`), so a joint draw never claims to change what it does not.
A rejected candidate counts as a repeat (the sampler draws again).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra_agent.agent.screening import same_launch, space_problem
from infra_agent.records import Change
from infra_agent.workspace.knobs import DomainError

ConfigKey = tuple[tuple[str, str, str], ...]


def config_key(config: Mapping[str, Any]) -> ConfigKey:
    return tuple(sorted((k, type(v).__name__, repr(v)) for k, v in config.items()))


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


class Candidates:
    """The tried configurations of a search, and the test a new one must pass."""

    def __init__(self, workspace: Any) -> None:
        self.workspace = workspace
        self.tried: set[ConfigKey] = set()  # as they launch (aliases followed)
        self._unseen: dict[tuple[Any, ...], bool] = {}  # (best, knob, value): renders as the best's launch

    def clean(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with each value as its knob parses it (``"16"`` and ``16.0`` are ``16``)."""
        out = {}
        for k, v in config.items():
            knob = self.workspace.knobs.get(k)
            if knob is not None:
                try:
                    v = knob.check(v)
                except DomainError:
                    pass
            out[k] = v
        return out

    def key(self, config: Mapping[str, Any]) -> ConfigKey:
        """What ``config`` launches as: its values parsed, each alias followed."""
        knobs = self.workspace.knobs
        return config_key({k: knobs[k].canonical(v) if k in knobs else v for k, v in self.clean(config).items()})

    def add(self, config: Mapping[str, Any]) -> None:
        self.tried.add(self.key(config))

    def effective(self, values: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` with each knob that would launch as ``base``'s value set back to it."""
        out = {}
        base_key = config_key(base)
        for k, v in values.items():
            old = base.get(k)
            knob = self.workspace.knobs.get(k)
            if old is not None and knob is not None and not _same(v, old):
                if knob.canonical(v) == knob.canonical(old):
                    v = old
                else:
                    # Rendering is the costly part of enumerating a discrete space: once per (best, knob, value).
                    key = (base_key, k, type(v).__name__, repr(v))
                    if key not in self._unseen:
                        self._unseen[key] = same_launch(self.workspace, {**base, k: v}, base)
                    if self._unseen[key]:
                        v = old
            out[k] = v
        return out

    def is_new(self, values: Mapping[str, Any], base: Mapping[str, Any], tried_changes: set[str]) -> bool:
        """An untried configuration that may run and that the launch tells from ``base``."""
        values = self.effective(values, base)
        config = self.clean({**base, **values})
        if self.key(config) in self.tried or Change(knobs=dict(values), diff=None).key() in tried_changes:
            return False
        if space_problem(self.workspace, config, set(values)) is not None:
            return False
        return any(not (k in base and _same(v, base[k])) for k, v in values.items())


__all__ = ["Candidates", "ConfigKey", "config_key"]
