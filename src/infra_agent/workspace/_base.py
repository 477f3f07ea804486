"""The shared base of every ``infra-agent.yaml`` model: unknown keys are an error.

A misspelled key would otherwise be dropped silently and its default used, so every
workspace model (targets, scenarios, criteria, checks, the workspace) derives from
:class:`_Strict`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
