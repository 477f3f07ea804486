"""Checks: the cheap gates under ``checks:`` in ``infra-agent.yaml``.

A :class:`CheckSpec` names a probe, its config (whose strings may hold ``{knob}``
placeholders) and the components it guards.  The helpers walk every string in such a
config, to check its placeholders and to render them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator

from infra_agent.workspace import template
from infra_agent.workspace._base import _Strict
from infra_agent.workspace.knobs import DomainError


class CheckSpec(_Strict):
    """A cheap gate run before (and beside) end-to-end experiments.

    ``probe`` is a registered probe (``kernel``, ``command``) or a dotted path; its
    ``config`` is that probe's typed config, where any string may hold ``{knob}``
    placeholders, rendered with the configuration under test (so a kernel check can
    follow ``lm_head_precision``).  ``components`` say what it guards: the planner
    runs a check first when a change touches code or a related knob.
    """

    name: str = Field(min_length=1)
    probe: str = Field(min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)
    components: list[str] = Field(default_factory=list)

    @field_validator("components")
    @classmethod
    def _known_components(cls, components: list[str]) -> list[str]:
        from infra_agent.vocabulary import check_component

        for i, component in enumerate(components):
            problem = check_component(component)
            if problem:
                raise DomainError((i,), problem, component)
        return components

    def placeholder_names(self) -> list[str]:
        return [n for _, text in _strings(self.config) for n in template.placeholders(text)]

    def render(self, knobs: Mapping[str, Any]) -> dict[str, Any]:
        """The config with every ``{knob}`` replaced by its value in ``knobs``."""
        from infra_agent.workspace.knobs import render_value

        values = {k: render_value(v) for k, v in knobs.items()}
        return _render_strings(self.config, values)


def _strings(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[tuple[str | int, ...], str]]:
    if isinstance(value, str):
        return [(path, value)]
    if isinstance(value, Mapping):
        return [x for k, v in value.items() for x in _strings(v, (*path, k))]
    if isinstance(value, list):
        return [x for i, v in enumerate(value) for x in _strings(v, (*path, i))]
    return []


def _render_strings(value: Any, values: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return template.render(value, values)
    if isinstance(value, Mapping):
        return {k: _render_strings(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_render_strings(v, values) for v in value]
    return value
